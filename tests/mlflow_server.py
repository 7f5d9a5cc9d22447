"""A real `mlflow server` on 127.0.0.1 for tests of tracking over HTTP: the ``server`` fixture (not started; a test
kills and restarts it) and ``mlflow_server`` (started: its URL and artifact folder). tests/conftest.py imports both."""

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


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
