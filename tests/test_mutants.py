"""The mutant script's own contract (the mutants themselves run with `make mutants`): every mutant still applies to
today's code, names killing tests that exist, and a missing target fails loudly."""

import pytest

from tests import mutants


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_to_the_current_code(mutant, tmp_path):
    target = tmp_path / mutant.path
    target.parent.mkdir(parents=True)
    original = (mutants.REPO / mutant.path).read_text()
    target.write_text(original)
    mutants.apply(mutant, tmp_path)
    assert target.read_text() != original
    for node in mutant.killers:
        test_file, name = node.split("::")
        assert f"def {name.split('[')[0]}(" in (mutants.REPO / test_file).read_text(), node


def test_a_missing_target_fails_loudly(tmp_path):
    m = mutants.MUTANTS[0]
    (tmp_path / m.path).parent.mkdir(parents=True)
    (tmp_path / m.path).write_text("the code moved\n")
    with pytest.raises(LookupError, match=f"mutant {m.name}: .* 0 times"):
        mutants.apply(m, tmp_path)
    assert len({m.name for m in mutants.MUTANTS}) == len(mutants.MUTANTS)
