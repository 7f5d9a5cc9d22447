"""Tracking against real stores: a real `mlflow server` on 127.0.0.1, and failure paths that must not leave RUNNING."""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import run_cli
from workbench import free_port
from workbench.distributed import Dist, JobEnv


@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    proc = subprocess.Popen(
        [str(mlflow_bin), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "artifacts")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, "mlflow server exited"
            assert time.monotonic() < deadline, "mlflow server did not come up"
            time.sleep(0.3)
        yield url, tmp_path / "artifacts"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


@pytest.mark.slow
def test_run_recorded_through_a_real_tracking_server(mlflow_server, tmp_path):
    url, artifact_root = mlflow_server
    proc = run_cli("experiment=quick", f"tracking.uri={url}", "tracking.experiment_name=server", "disable_tqdm=true",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"open {url}" in proc.stdout
    client = MlflowClient(tracking_uri=url)
    runs = client.search_runs([client.get_experiment_by_name("server").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["steps"] == 20
    assert not (tmp_path / "mlflow.db").exists()  # nothing went to the local default store
    # Artifacts travelled over HTTP into the server's artifact destination.
    names = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"config.yaml", "checkpoints", "training_curves.png"} <= names
    assert list(artifact_root.rglob("checkpoint-20.pt"))


def test_failure_after_the_run_started_ends_failed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("experiment=quick", "compute_metrics=tests.plugins.broken_metrics", cwd=tmp_path,
                   env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode != 0 and "metric exploded" in proc.stderr
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    assert not list((tmp_path / "outputs").rglob("*.tmp*"))


@pytest.mark.parametrize("local_rank, rank, on_each_node, expect_log, expect_save", [
    (0, 0, True, True, True), (0, 2, True, True, False), (1, 1, True, False, False), (0, 2, False, False, False),
])
def test_rank_gating(local_rank, rank, on_each_node, expect_log, expect_save):
    env = JobEnv(rank=rank, world_size=4, local_rank=local_rank, local_world_size=2)
    d = Dist(env, "gloo", None, owns_group=False, log_on_each_node=on_each_node, save_on_each_node=False)
    assert d.should_log is expect_log
    assert d.should_save is expect_save  # save_on_each_node=False: world rank 0 only
    saving = Dist(env, "gloo", None, owns_group=False, save_on_each_node=True)
    assert saving.should_save is (local_rank == 0)
    assert d.is_main is (rank == 0)


def _store_and_artifacts(tmp_path: Path, *own: Path) -> list[Path]:
    """Every file the tracking store holds: the SQLite file and the whole artifact tree (all of tmp_path but the run
    folders and Hydra's log folder, which are the user's own: a run folder keeps the secret for resuming)."""
    own = (*own, tmp_path / "outputs")
    return [p for p in tmp_path.rglob("*") if p.is_file() and not any(d in p.parents for d in own)]


@pytest.mark.slow
def test_secrets_never_reach_mlflow(tmp_path):
    """A pinned secure_seed and a run's stream secret appear nowhere in the store or its artifacts, in any form, and
    the published checkpoint holds nothing (such as a digest of config + seed) that would let a seed be brute-forced."""
    import struct

    import torch

    from workbench import checkpoint

    seed = 271828182845
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for name, extra in [("pinned", [f"privacy.secure_seed={seed}"]), ("fresh", [])]:
        run_dir = tmp_path / name
        proc = run_cli("experiment=quick", "save_steps=5", f"output_dir={run_dir}", "disable_tqdm=true", *extra,
                       cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
        assert proc.returncode == 0, proc.stderr[-2000:]
        secret = checkpoint.load(checkpoint.list_checkpoints(run_dir)[-1])["secret"]
        if name == "pinned":
            assert secret == seed
        forms = [str(secret).encode(), hex(secret).encode(), struct.pack("<q", secret), struct.pack(">q", secret)]
        files = _store_and_artifacts(tmp_path, tmp_path / "pinned", tmp_path / "fresh")
        published = [p for p in files if p.suffix == ".pt"]
        assert (tmp_path / "mlflow.db") in files and published and any(p.name == "config.yaml" for p in files)
        for path in files:
            blob = path.read_bytes()
            assert not [f for f in forms if f in blob], f"the secret leaked into {path}"
        for path in published:
            state = torch.load(path, weights_only=True)
            assert "secret" not in state and "privacy_digest" not in state
    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("workbench").experiment_id],
                             "params.output_dir LIKE '%pinned'")[0]
    assert run.data.params["privacy.secure_seed"] == "<redacted>"
    assert "privacy.secure_seed=<redacted>" in run.data.tags["overrides"]
