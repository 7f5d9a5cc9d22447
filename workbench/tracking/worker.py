"""The store in a worker process: importing MLflow and opening its store take seconds of CPU, which the worker spends
on another core while the job starts and trains. The protocol (one pickled call in, one reply out, over the worker's
stdin and stdout), the worker's loop (:func:`serve`, run by ``python -m workbench.tracking serve <uri>``), a worker
started early by the CLI (:func:`prestart`), and every worker of this process ended at exit.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

from workbench.tracking.outbox import StoreError
from workbench.tracking.store import STORE_CALLS, Store
from workbench.tracking.uris import CHECK_TIMEOUT, FAST_FAIL_ENV, uri_problem


class WorkerStore:
    """A :class:`~workbench.tracking.store.Store` in a worker process (``python -m workbench.tracking serve <uri>``):
    MLflow's imports and its store open on another core while this process starts and trains. Calls go one at a time,
    pickled over the worker's stdin and stdout; a worker that died is replaced at the next call."""

    def __init__(self, uri: str):
        self.uri = uri
        self._lock = threading.Lock()
        self._proc = _adopt_prestarted(uri) or _spawn(uri)
        self._used = False  # a worker that was asked something may be writing to the store: it is never killed
        _STORES.append(self)

    def __getattr__(self, name: str):
        if name not in STORE_CALLS:
            raise AttributeError(name)
        return lambda *args: self._call(name, args)

    def _call(self, name: str, args: tuple):
        with self._lock:
            if self._proc.poll() is not None:
                self._proc = _spawn(self.uri)
            self._used = True
            try:
                pickle.dump((name, args), self._proc.stdin)
                self._proc.stdin.flush()
                ok, value = pickle.load(self._proc.stdout)
            except (OSError, EOFError, pickle.UnpicklingError) as e:
                self._proc.kill()
                raise StoreError(f"the tracking worker stopped ({type(e).__name__}: {e})") from None
        if ok:
            return value
        raise value

    def close(self, timeout: float = 5.0) -> None:
        """Let the worker finish the call it is on and leave; one that does not within `timeout` is killed."""
        _close_worker(self._proc, timeout)


def _spawn(uri: str) -> subprocess.Popen:
    for key, value in FAST_FAIL_ENV.items():  # the worker's HTTP calls fail fast; the outbox retries them
        os.environ.setdefault(key, value)
    here = str(Path(__file__).resolve().parent.parent.parent)  # the worker imports this very workbench
    # A helper, not one of the job's ranks: nothing in its environment says it is one (to torchrun, submitit, SLURM,
    # or whoever looks for the job's ranks by their environment).
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV and not k.startswith(RANK_ENV_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "workbench.tracking", "serve", uri], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)
    global _AT_EXIT
    if not _AT_EXIT:
        import atexit

        atexit.register(_end_workers)
        _AT_EXIT = True
    return proc


def _close_worker(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


RANK_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")
RANK_ENV_PREFIXES = ("SLURM_", "SUBMITIT_", "TORCHELASTIC_")
_AT_EXIT = False
_STORES: list[WorkerStore] = []  # every worker store of this process: ended at exit if its tracker did not end it
_PRESTARTED: dict[str, subprocess.Popen] = {}


def prestart(uri: str) -> None:
    """Start the worker for `uri` now, before this process imports torch: the CLI calls it once the config is
    checked. Nothing is opened until the job asks (a refused job leaves no store); an unused worker is killed at exit."""
    if uri not in _PRESTARTED and not uri_problem(uri):
        _PRESTARTED[uri] = _spawn(uri)


def _adopt_prestarted(uri: str) -> subprocess.Popen | None:
    proc = _PRESTARTED.pop(uri, None)
    return proc if proc is not None and proc.poll() is None else None


def _end_workers() -> None:
    """At exit (a refused or failed job): a worker never asked anything is killed at once; one that was may be in the
    middle of a store write, so it is let finish its call and leave (killed only after CHECK_TIMEOUT seconds)."""
    for proc in _PRESTARTED.values():
        proc.kill()
    for store in _STORES:
        if store._used:
            _close_worker(store._proc, CHECK_TIMEOUT)
        else:
            store._proc.kill()


def serve(uri: str) -> None:
    """The worker's loop: one (call, args) in, one (ok, value or StoreError) out, until stdin closes."""
    import signal

    # Ctrl-C and SIGTERM to the job's process group are the job's to handle: it ends its run through this worker,
    # which leaves when the job closes its stdin (or dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever MLflow prints goes to stderr, never into the channel
    # The seconds this worker is for, spent while the job imports torch: MLflow and its SQL store.
    import mlflow  # noqa: F401

    if uri.startswith("sqlite:///"):
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    import select

    store, requests = Store(uri), sys.stdin.buffer
    # The closing figure's matplotlib, once the run exists and no call is waiting: while the job trains.
    idle_imports, run_made = ["workbench.plots"], False
    while True:
        if run_made and idle_imports and not select.select([requests], [], [], 0)[0]:
            __import__(idle_imports.pop())
            continue
        try:
            name, args = pickle.load(requests)
        except EOFError:  # every call is answered: leave without the interpreter's teardown (a second of CPU)
            sys.stderr.flush()
            os._exit(0)
        run_made = run_made or name in ("create_run", "set_status")
        try:
            reply = (True, getattr(store, name)(*args))
        except StoreError as e:
            reply = (False, e)
        except Exception as e:  # noqa: BLE001 - anything else is the store's failure too
            reply = (False, StoreError(" ".join(str(e).split()) or type(e).__name__))
        pickle.dump(reply, channel)
        channel.flush()
