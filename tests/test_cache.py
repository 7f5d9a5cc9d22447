"""workbench.cache: a stored value comes back only for the very same inputs; the digits read without scikit-learn
split exactly as scikit-learn splits them."""

import pytest
import torch

from workbench import cache


def test_a_value_is_reused_only_for_the_same_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    calls = []

    def compute(value):
        calls.append(value)
        return value

    inputs = dict(kind="pld", sample_rate=0.1, steps=100, target_epsilon=3.0, delta=1e-5, code="v1")
    assert cache.cached("calibrate_noise", lambda: compute(1.25), **inputs) == 1.25
    assert cache.cached("calibrate_noise", lambda: compute(9.0), **inputs) == 1.25  # stored, not recomputed
    assert calls == [1.25]
    for key, other in (("sample_rate", 0.2), ("steps", 101), ("target_epsilon", 3.5), ("delta", 1e-6),
                       ("code", "v2"), ("kind", "rdp")):
        assert cache.cached("calibrate_noise", lambda: compute(other), **{**inputs, key: other}) == other
    assert cache.cached("max_steps", lambda: compute(7), **inputs) == 7  # another function, another entry
    assert len(calls) == 8


def test_an_unusable_cache_folder_computes_afresh(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(blocker / "cache"))
    assert cache.cached("x", lambda: 3, a=1) == 3
    (tmp_path / "ok").mkdir()
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "ok"))
    assert cache.cached("x", lambda: 4, a=1) == 4
    next((tmp_path / "ok").glob("x-*.json")).write_text("{broken")  # a torn or edited entry is not trusted
    assert cache.cached("x", lambda: 5, a=1) == 5


def test_digits_split_equals_scikit_learn_and_survives_the_cache(tmp_path, monkeypatch):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from workbench.data import Digits

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    x, y = load_digits(return_X_y=True)
    x_tr, x_ev, y_tr, y_ev = train_test_split(x, y, test_size=0.3, random_state=3, stratify=y)
    for _ in range(2):  # computed, then read back
        train, evaluation = Digits("train", 0.3, 3).tensors, Digits("eval", 0.3, 3).tensors
        assert torch.equal(train[0], torch.tensor(x_tr / 16.0, dtype=torch.float32))
        assert torch.equal(train[1], torch.tensor(y_tr)) and torch.equal(evaluation[1], torch.tensor(y_ev))
        assert torch.equal(evaluation[0], torch.tensor(x_ev / 16.0, dtype=torch.float32))
    assert len(list(tmp_path.glob("digits_split-*.json"))) == 1


def test_a_rerun_reads_its_epsilon_schedule_back_equal_to_a_fresh_computation(tmp_path, monkeypatch):
    from workbench.privacy import Accountant, EpsilonSchedule

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    steps = [10, 20]
    first = EpsilonSchedule(Accountant("pld", 0.1, 1.2), 1e-5, steps)
    values = [first.get(s) for s in steps]
    written = len(list(tmp_path.glob("epsilon-*.json")))  # the last line, and the lines' grid (tried at the last)
    assert written in (2, 3)
    with monkeypatch.context() as m:  # the rerun's every composition, on any grid, is read back
        m.setattr(Accountant, "_compute_epsilon", lambda *a: pytest.fail("recomputed instead of read back"))
        assert [EpsilonSchedule(Accountant("pld", 0.1, 1.2), 1e-5, steps).get(s) for s in steps] == values
    other = Accountant("pld", 0.1, 1.3)  # another mechanism: its own entries
    assert EpsilonSchedule(other, 1e-5, steps).get(20) < values[1]
    fresh = Accountant("pld", 0.1, 1.2)  # nothing on disk read
    lines = first.lines_accountant(values[-1])
    assert values == [lines.epsilon(10, 1e-5), fresh.epsilon(20, 1e-5)]
    assert len(list(tmp_path.glob("epsilon-*.json"))) == 2 * written


def test_a_cached_epsilon_depends_on_every_accounting_module_it_is_computed_by():
    """code_version hashes accountant.MODULES: a module they import from privacy/accounting/ but that is not listed
    (the root solver, say) could change a calibrated sigma while the cache kept serving the old one."""
    import re
    from pathlib import Path

    from workbench.privacy.accounting.accountant import MODULES

    here = Path(cache.__file__).resolve().parent / "privacy" / "accounting"
    imported = {name for module in MODULES
                for name in re.findall(r"workbench\.privacy\.accounting\.(\w+)", (here / f"{module}.py").read_text())}
    assert imported <= set(MODULES), f"not in code_version: {sorted(imported - set(MODULES))}"
