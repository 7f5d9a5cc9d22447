"""Tracking against real stores: a real `mlflow server` on 127.0.0.1, and failure paths that must not leave RUNNING."""

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import run_cli
from workbench.distributed import Dist, JobEnv


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on 127.0.0.1, on a port the OS picks when it binds (--port 0: no other process can take
    it between choosing and binding); uvicorn's start-up line says which."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(mlflow_bin), "server", "--host", "127.0.0.1", "--port", "0", "--workers", "1",
             "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
             "--artifacts-destination", str(tmp_path / "artifacts")],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = None
        while url is None or not _healthy(url):  # polled on state; pytest-timeout bounds a server that never comes up
            assert proc.poll() is None, f"mlflow server exited: {log.read_text()[-2000:]}"
            found = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log.read_text())
            url = found.group(1) if found else None
            time.sleep(0.3)
        yield url, tmp_path / "artifacts"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


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
