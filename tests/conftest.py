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


TIMED = ("samples_per_second",)  # the one logged metric whose value is a measurement, not a function of the run


def metric_history(uri: str, run_id: str) -> list[tuple[str, int, float]]:
    """Every (metric, step, value) a run holds in its MLflow store, in the store's order (MLflow's sampled system
    metrics aside)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return [(key, m.step, m.value) for key in sorted(client.get_run(run_id).data.metrics)
            if not key.startswith("system/") for m in client.get_metric_history(run_id, key)]


def assert_same_history(uri: str, resumed: str, whole: str, whole_uri: str | None = None) -> None:
    """A resumed run's whole metric history equals an uninterrupted run's, pair by pair: no (metric, step) twice,
    the same (metric, step) pairs, the same values (a timing's aside)."""
    got, want = metric_history(uri, resumed), metric_history(whole_uri or uri, whole)
    pairs = [(k, s) for k, s, _ in got]
    twice = sorted({p for p in pairs if pairs.count(p) > 1})
    assert not twice, f"(metric, step) logged more than once: {twice}"
    assert set(pairs) == {(k, s) for k, s, _ in want}, set(pairs) ^ {(k, s) for k, s, _ in want}
    assert {x for x in got if x[0] not in TIMED} == {x for x in want if x[0] not in TIMED}


from tests.slurm_cluster import slurm_cluster, slurm_two_nodes  # noqa: E402,F401  (a real SLURM with accounting: one node, session-scoped; two nodes, module-scoped)
from tests.mlflow_server import mlflow_server, server  # noqa: E402,F401  (a real `mlflow server` a test can kill)



@pytest.hookimpl(trylast=True)  # after -m / -k deselection: count only the SLURM tests this session runs
def pytest_collection_modifyitems(config, items):
    from tests.slurm_cluster import REQUIRE_ENV, SLURM_FIXTURES, slurm_available

    slurm_items = [item for item in items if set(SLURM_FIXTURES) & set(getattr(item, "fixturenames", ()))]
    config.stash[_SLURM_TESTS] = [item.nodeid for item in slurm_items]
    if slurm_items:
        ok, reason = slurm_available()
        required = os.environ.get(REQUIRE_ENV, "") not in ("", "0", "false", "no")
        skip = pytest.mark.skipif(not ok and not required, reason=f"real SLURM unavailable ({reason}) and {REQUIRE_ENV} "
                                  "unset: CI sets it, so there the missing SLURM fails the tests instead")
        for item in slurm_items:
            item.add_marker(skip)


_SLURM_TESTS = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line saying whether the SLURM tests ran on a real cluster, and why not when they did not (`make test` runs
    pytest -q, which hides skip reasons)."""
    from tests.slurm_cluster import REQUIRE_ENV, slurm_available

    slurm_tests = config.stash.get(_SLURM_TESTS, [])
    if not slurm_tests:
        return
    skipped = {r.nodeid for r in terminalreporter.stats.get("skipped", [])}
    not_run = [t for t in slurm_tests if t in skipped]
    if not not_run:
        terminalreporter.write_line(f"SLURM: the {len(slurm_tests)} SLURM tests ran on a real local cluster")
        return
    ok, reason = slurm_available()
    terminalreporter.write_line(f"SLURM: {len(not_run)} of {len(slurm_tests)} SLURM tests skipped: "
                                f"{reason or 'the cluster failed to start (pytest -rs shows why)'} "
                                f"(CI sets {REQUIRE_ENV}=1, so there they fail instead)")
