"""The outbox and its spool (workbench/tracking/outbox.py, upload.py) against a real `mlflow server` that a test kills:
a dead server delays lines, never steps; what it never took is spooled in the run folder and synced later, once."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import run_cli


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


def _logged_steps(client: MlflowClient, key: str = "learning_rate") -> list[int]:
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
    # The model the job logged at its end went through the spool too: READY, with the run's final epsilon.
    (output,) = run.outputs.model_outputs
    logged = client.get_logged_model(output.model_id)
    assert str(logged.status).endswith("READY") and logged.source_run_id == run.info.run_id and output.step == 40
    assert float(logged.tags["workbench.epsilon"]) == run.data.metrics["epsilon"]
    assert "workbench.model_error" not in run.data.tags


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
