"""Tracking against real stores: a real `mlflow server` on 127.0.0.1, and failure paths that must not leave RUNNING."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import run_cli
from workbench.distributed import Dist, JobEnv


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 over one store, that a test can kill and start again (same store, and the
    same port unless told otherwise)."""

    def __init__(self, root: Path):
        self.root, self.proc, self.port = root, None, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int | None = None) -> str:
        """Start on `port` (a restart on the port it had), else on one the OS picks as it binds (--port 0: nobody can
        take it between choosing and binding); uvicorn's start-up line says which."""
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        log = self.root / "server.log"
        for _ in range(5):  # a restart's port can be taken by another process while the server is away
            with open(log, "wb") as out:
                self.proc = subprocess.Popen(
                    [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port",
                     str(port or 0), "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}",
                     "--artifacts-destination", str(self.root / "artifacts")],
                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            while self.proc.poll() is None:  # polled on state; pytest-timeout bounds a server that never comes up
                found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", log.read_text())
                if found and _healthy(f"http://127.0.0.1:{found.group(1)}"):
                    self.port = int(found.group(1))
                    return self.url
                time.sleep(0.3)
            self.kill()
        raise AssertionError(f"mlflow server did not come up: {log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)


@pytest.fixture
def server(tmp_path):
    s = MlflowServer(tmp_path)
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture
def mlflow_server(server, tmp_path):
    yield server.start(), tmp_path / "artifacts"


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


@pytest.mark.parametrize("args, message", [
    (["tracking.uri=notascheme://x"], "not a tracking URI"),
    (["tracking.uri=:::"], "not a tracking URI"),
    (["tracking.uri=sqlite:////no/such/dir/mlflow.db"], "does not exist"),
    (["tracking.experiment_name=''"], "must not be empty"),
    (["tracking.uri=http://127.0.0.1:{port}"], "cannot be used"),  # nothing listens there
])
def test_unusable_tracking_store_is_refused_before_any_work(tmp_path, args, message):
    with socket.socket() as bound:  # bound, never listening: connections are refused and no one else can take it
        bound.bind(("127.0.0.1", 0))
        args = [a.replace("{port}", str(bound.getsockname()[1])) for a in args]
        proc = run_cli("experiment=quick", f"output_dir={tmp_path / 'run'}", *args, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not Path("/no/such/dir").exists()  # MLflow would have created a mistyped folder


def _slow_run(url: str, run_dir: Path | None, *extra: str, cwd: Path | None = None,
              env: dict | None = None) -> subprocess.Popen:
    """A CLI run long enough (0.2 s a batch) for a test to kill and restart its server in the middle. `run_dir` None:
    no output_dir, as a user types it (Hydra's run folder under `cwd`)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1",
           "WB_FETCH_SLEEP": "0.2", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "workbench", "experiment=quick", "data.train._target_=tests.plugins.SlowSynthetic",
         "max_steps=40", "logging_steps=2", "save_steps=10", f"tracking.uri={url}", "tracking.experiment_name=faults",
         *([f"output_dir={run_dir}"] if run_dir else []), "disable_tqdm=true", *extra],
        cwd=cwd or run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(condition, what: str, proc: subprocess.Popen, limit: float = 240):
    deadline = time.monotonic() + limit
    while not (value := condition()):
        assert proc.poll() is None, f"the run ended before {what}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def _logged_steps(client: MlflowClient, key: str = "loss") -> list[int]:
    exp = client.get_experiment_by_name("faults")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, key)) if runs else []


@pytest.mark.slow
def test_server_killed_and_restarted_loses_no_line(server, tmp_path):
    from workbench import checkpoint

    url = server.start()
    client = MlflowClient(tracking_uri=url)
    proc = _slow_run(url, tmp_path / "run", "tracking.flush_timeout=600")
    try:
        _wait_for(lambda: _logged_steps(client), "the first logged line", proc)
        server.kill()
        # Training goes on while the server is away: a checkpoint is written after the kill.
        _wait_for(lambda: any(p.name == "checkpoint-20.pt" for p in checkpoint.list_checkpoints(tmp_path / "run")),
                  "a checkpoint while the server is down", proc)
        server.start(server.port)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "spooled" not in out and not (tmp_path / "run" / "tracking-spool").exists()
    run = client.search_runs([client.get_experiment_by_name("faults").experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert _logged_steps(client) == list(range(2, 41, 2))  # every line, once
    assert {"config.yaml", "checkpoints", "training_curves.png"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


@pytest.mark.slow
def test_server_killed_for_good_spools_and_syncs_later(server, tmp_path):
    url = server.start()
    client = MlflowClient(tracking_uri=url)
    proc = _slow_run(url, tmp_path / "run", "tracking.flush_timeout=1")
    try:
        _wait_for(lambda: _logged_steps(client), "the first logged line", proc)
        server.kill()
        out, err = proc.communicate(timeout=600)  # the guard against a hang: it must end on its own
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err
    assert f"python -m workbench.tracking sync {tmp_path / 'run'}" in out.strip().splitlines()[-1]
    assert list((tmp_path / "run" / "tracking-spool").glob("ops-*.jsonl"))

    new_url = server.start()  # the server comes back elsewhere: sync is told where
    sync = run_cli("sync", str(tmp_path / "run"), "--tracking-uri", new_url, cwd=tmp_path,
                   module=("-m", "workbench.tracking"))
    assert sync.returncode == 0, sync.stderr[-2000:]
    client = MlflowClient(tracking_uri=new_url)
    run = client.search_runs([client.get_experiment_by_name("faults").experiment_id])[0]
    assert run.info.status == "FINISHED"  # the same run, ended as the job ended it
    assert _logged_steps(client) == list(range(2, 41, 2))
    assert {"config.yaml", "checkpoints", "training_curves.png"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert run.data.metrics["steps"] == 40
    assert not (tmp_path / "run" / "tracking-spool").exists()


@pytest.mark.slow
def test_a_plain_run_spools_in_its_run_folder_where_the_closing_line_says(server, tmp_path):
    """No output_dir (Hydra picks the run folder after the tracker exists): the spool is in that run folder, the
    closing line's own sync command uploads it, and no temporary folder is left behind."""
    url = server.start()
    client = MlflowClient(tracking_uri=url)
    tmp, work = tmp_path / "tmp", tmp_path / "work"
    tmp.mkdir(), work.mkdir()
    proc = _slow_run(url, None, "tracking.flush_timeout=1", cwd=work, env={"TMPDIR": str(tmp)})
    try:
        _wait_for(lambda: _logged_steps(client), "the first logged line", proc)
        server.kill()
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    last = out.strip().splitlines()[-1]
    command = re.search(r"upload with python -m workbench\.tracking sync (\S+)$", last)
    assert command, last
    run_folder = Path(command.group(1))
    assert work in run_folder.parents and list((run_folder / "tracking-spool").glob("ops-*.jsonl"))
    assert not list(tmp.glob("workbench-tracking-*"))  # nothing spooled, or left empty, in a temporary folder

    server.start(server.port)
    sync = run_cli("sync", str(run_folder), cwd=work, module=("-m", "workbench.tracking"))  # as the line says
    assert sync.returncode == 0, sync.stderr[-2000:]
    run = client.search_runs([client.get_experiment_by_name("faults").experiment_id])[0]
    assert run.info.status == "FINISHED" and _logged_steps(client) == list(range(2, 41, 2))
    assert not (run_folder / "tracking-spool").exists()


def test_tracking_worker_answers_as_the_store_does_and_is_replaced_when_it_dies(tmp_path):
    """The CLI's tracker talks to MLflow through a worker process (workbench.tracking.WorkerStore): same calls, same
    refusals (a 404 stays a refusal the outbox will not retry), and a worker that died is replaced at the next call."""
    from workbench.outbox import StoreError, permanent
    from workbench.tracking import WorkerStore

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = WorkerStore(uri)
    try:
        run_id = store.create_run(store.experiment_id("worker"), "r", {"k": "v"})
        store.send(run_id, ("metrics", [[{"loss": 0.5}, 3, 0]]))
        with pytest.raises(StoreError) as refused:
            store.status("no-such-run")
        assert refused.value.http_status == 404 and permanent(refused.value)
        store._proc.kill()
        store._proc.wait()
        store.send(run_id, ("status", "FINISHED"))
        assert store.status(run_id) == "FINISHED"
    finally:
        store.close()
    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.data.metrics["loss"] == 0.5 and run.data.tags["k"] == "v" and run.data.tags["status"] == "finished"
