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
