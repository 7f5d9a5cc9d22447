"""The README works as written: every command in it is accepted as it stands, every file it names is in the
repository, and a run creates the folders it says (one of its commands run verbatim)."""

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

README = (REPO / "README.md").read_text()
COMMANDS = [shlex.join(shlex.split(line, comments=True)) for line in README.splitlines() if line.startswith("    ")
            and line.split()[0] in ("python", "torchrun", "make", "source", "mlflow")]
WORKBENCH = [c for c in COMMANDS if " -m workbench" in c and not c.startswith("python -m workbench.")]


def _workbench_args(command: str) -> list[str]:
    words = shlex.split(command)  # as a shell would
    return words[words.index("workbench") + 1:]


def test_readme_lists_the_commands_this_test_checks():
    assert len(WORKBENCH) >= 10 and any(c.startswith("torchrun") for c in WORKBENCH)
    assert "make run" in COMMANDS and "make test" in COMMANDS and "source .venv/bin/activate" in COMMANDS


@pytest.mark.parametrize("command", WORKBENCH)
def test_every_readme_command_is_accepted_as_written(command):
    """The CLI's own pre-check (compose + validate every sweep value) passes on each command, unchanged."""
    from workbench.__main__ import check_args

    assert check_args(_workbench_args(command))


def test_make_targets_and_files_the_docs_name_exist():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    assert {c.split()[1] for c in COMMANDS if c.startswith("make ")} <= targets
    assert "$(VENV)" in (REPO / "Makefile").read_text() and ".venv" in README  # the venv the README activates
    for doc in ("README.md", "Makefile", "docs/API.md", "docs/DESIGN.md"):
        text = (REPO / doc).read_text()
        named = set(re.findall(r"(?<![\w/.:$<])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|ipynb|png|json|sh|yaml))\b", text))
        missing = sorted(p for p in named if not (REPO / p).exists())
        assert not missing, f"{doc} names files that are not in the repository: {missing}"


@pytest.mark.slow
def test_a_readme_command_verbatim_creates_the_folders_the_readme_lists(tmp_path):
    command = next(c for c in WORKBENCH if "privacy=none" in c)
    proc = run_cli(*_workbench_args(command), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("done: ")
    assert {p.name for p in tmp_path.iterdir()} == {"mlflow.db", "mlruns", "outputs"}
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    assert {".hydra", "checkpoints"} <= {p.name for p in run_dir.iterdir()}
    for folder in ("`mlflow.db`", "`mlruns/`", "`outputs/<date>/<time>/`", "`.hydra/`", "`checkpoints/`"):
        assert folder in README


def test_the_layout_names_every_module():
    """README's layout lists every module of the package (a subpackage: its folder and each file in it)."""
    layout = README.split("## Layout", 1)[1].split("\n## ", 1)[0]
    missing = []
    for path in sorted((REPO / "workbench").rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parent == Path("workbench"):
            named = rel.name == "__init__.py" or rel.as_posix() in layout
        else:
            named = f"{rel.parent.as_posix()}/" in layout and (rel.name == "__init__.py" or rel.name in layout)
        if not named:
            missing.append(rel.as_posix())
    assert not missing, f"README's layout leaves out {missing}"
