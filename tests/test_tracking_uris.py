"""The pre-run checks of workbench/tracking/uris.py: an unusable store is refused in one line, before any work."""

import socket
from pathlib import Path

import pytest

from tests.conftest import run_cli


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


def test_the_ui_link_opens_mlflows_training_view_on_the_run_or_the_runs_table():
    """MLflow 3.17's UI picks its view by ``workflowType`` in the link (the experiment's kind tag does not switch it),
    and shows the runs table's metric columns from a shared view named by ``viewStateShareKey``."""
    from workbench.tracking import ui_command

    ml = "workflowType=machine_learning"
    assert ui_command("http://host:5000/", "3", "abc") == f"open http://host:5000/#/experiments/3/runs/abc?{ml}"
    assert ui_command("https://host", "3") == f"open https://host/#/experiments/3/runs?viewStateShareKey=workbench&{ml}"
    assert ui_command("sqlite:////tmp/m.db", "3", "abc") == (
        f"mlflow ui --backend-store-uri sqlite:////tmp/m.db, then open http://127.0.0.1:5000/#/experiments/3/runs/abc?{ml}")
    assert ui_command("sqlite:////tmp/m.db") == (
        f"mlflow ui --backend-store-uri sqlite:////tmp/m.db, then open http://127.0.0.1:5000/#/experiments?{ml}")
