"""The house's layers (docs/DESIGN.md, "Parts"): import-linter's contracts in pyproject.toml hold, so no import points
up a layer and no two modules import each other, and the contracts do refuse an upward import."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")  # import-linter, a dev dependency (pyproject.toml)
    assert exe.exists(), f"lint-imports is not installed beside {sys.executable}: pip install -e '.[dev]'"
    return subprocess.run([str(exe), "--no-cache", str(root / "pyproject.toml")], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})


def test_imports_point_down_the_layers_and_close_no_circle():
    proc = _lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_the_contract_refuses_a_job_that_imports_the_sweep(tmp_path):
    """Not a vacuous contract: the upward import this layout removed (the job reaching the sweep) breaks it again."""
    shutil.copytree(REPO / "workbench", tmp_path / "workbench", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    run = tmp_path / "workbench" / "run.py"
    run.write_text(run.read_text() + "\n\ndef _upward():\n    from workbench import sweep  # noqa: F401\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0 and "workbench.run -> workbench.sweep" in proc.stdout, proc.stdout[-4000:]


def test_the_old_clipping_path_is_the_same_modules():
    """workbench/clipping/ moved to workbench/privacy/clipping/; the old import path names the very same modules."""
    import workbench.clipping
    import workbench.clipping.book_keeping
    import workbench.privacy.clipping
    import workbench.privacy.clipping.book_keeping
    from workbench.clipping import fastest_grad_sample_mode
    from workbench.clipping.bound import RHO

    assert workbench.clipping is workbench.privacy.clipping
    assert workbench.clipping.book_keeping is workbench.privacy.clipping.book_keeping
    assert fastest_grad_sample_mode is workbench.privacy.clipping.fastest_grad_sample_mode
    assert RHO is workbench.privacy.clipping.bound.RHO


CITED = r"(?<![\w/.-])((?:workbench|tests|docs|benchmarks|conf|notebooks)/[\w/.-]*\w)"


def test_every_file_the_code_cites_exists():
    """Docstrings and comments point at files (``workbench/privacy/clipping/bound.py``, ``docs/DESIGN.md``); a move
    that leaves one pointing nowhere fails here. Folders count when they end in "/"."""
    import re

    sources = [*(REPO / "workbench").rglob("*.py"), *(REPO / "benchmarks").glob("*.py"), *(REPO / "conf").rglob("*.yaml"),
               *(p for p in (REPO / "tests").glob("*.py") if p.name != "test_architecture.py")]
    missing = {}
    for source in sources:
        for cited in re.findall(CITED, source.read_text()):
            cited = cited.rstrip(".")
            if not (REPO / cited).exists():
                missing.setdefault(str(source.relative_to(REPO)), []).append(cited)
    assert not missing, f"files cited but not in the repository: {missing}"


def test_no_product_module_mixes_concerns_past_400_lines():
    """The house's size rule (issue 20): a module past ~400 lines is one concern or it is split. The exceptions are
    named here with the one concern each holds."""
    one_concern = {"config.py": "the structured config: one schema, its ranges and its one-line validation"}
    long = {str(p.relative_to(REPO / "workbench")): n for p in (REPO / "workbench").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 420}
    assert set(long) <= set(one_concern), f"modules past 420 lines: {long}"
