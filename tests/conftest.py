import os
import subprocess
import sys
from pathlib import Path

import pytest

# Tiny models on a 2-core machine: one intra-op thread per process is much faster than two fighting ones.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Every test runs in its own folder: MLflow's ./mlruns, Hydra's outputs/ never land in the repository."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # each test names its store; none leaks into the next


@pytest.fixture
def mlflow_uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def make_cfg(tmp_path, mlflow_uri):
    """Compose the real conf/ with overrides, pointed at a temporary run folder and MLflow store."""
    from workbench import compose

    made = []

    def make(*overrides: str):  # a fresh run folder each call (the first is tmp_path/run): runs never share one
        made.append(tmp_path / ("run" if not made else f"run-{len(made) + 1}"))
        return compose([f"output_dir={made[-1]}", f"tracking.uri={mlflow_uri}", "disable_tqdm=true", *overrides])

    return make


def run_cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300, module=("-m", "workbench")):
    """Run `python -m workbench ...` as a user would; returns the CompletedProcess."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, *module, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


from tests.slurm_cluster import slurm_cluster  # noqa: E402,F401  (session-scoped: a real SLURM with accounting)
