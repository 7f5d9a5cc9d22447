"""Rank-zero MLflow tracking: one run per job, ended FINISHED or FAILED, never left RUNNING.

Only world rank 0 talks to MLflow; every other rank gets a :class:`NullTracker` with the same methods. A job's tracker
talks to MLflow through a worker process (:class:`WorkerStore`): importing MLflow and opening its store take seconds
of CPU, which the worker spends on another core while the job starts and trains.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from workbench.errors import WorkbenchError
from workbench.outbox import Outbox, StoreError, read_spool, spool_dir, stage, tidy, unstage, write_spool

log = logging.getLogger(__name__)

PARENT_TAG = "mlflow.parentRunId"
SWEEP_TAG = "workbench.sweep_dir"


def tracking_uri(configured: str | None) -> str:
    """tracking.uri, else $MLFLOW_TRACKING_URI, else SQLite in the working directory (MLflow 3.13+ refuses ./mlruns)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def ui_command(uri: str) -> str:
    if uri.startswith(("http://", "https://")):
        return f"open {uri}"
    return f"mlflow ui --backend-store-uri {uri}"


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# A pinned privacy.secure_seed as it appears in override strings (`privacy.secure_seed=N`, `+privacy.secure_seed=N`).
_SECRET_OVERRIDE = re.compile(r"(secure_seed\s*=\s*)[^\s,]+")


def scrub(text: str) -> str:
    """Text as MLflow may show it: whoever knows a pinned secure_seed can strip the noise and see the batches."""
    return _SECRET_OVERRIDE.sub(r"\1<redacted>", text)


def redacted(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as MLflow may show it: no pinned privacy.secure_seed, in its own field or in a tag."""
    container = OmegaConf.to_container(cfg, resolve=True)
    if container.get("privacy", {}).get("secure_seed") is not None:
        container["privacy"]["secure_seed"] = "<redacted>"
    tags = container.get("tracking", {}).get("tags") or {}
    for k, v in tags.items():
        tags[k] = scrub(str(v))
    return container


def _retry(fn, attempts: int = 8):
    """Concurrent sweep points on one SQLite file can briefly see 'database is locked': retry with backoff."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - only lock errors are retried
            if "locked" not in str(e).lower() or i == attempts - 1:
                raise
            time.sleep(0.2 * 2**i)


_READY_STORES: set[str] = set()


def init_store(uri: str) -> None:
    """Create and migrate a SQLite store once, under a file lock, before this process logs anything: processes
    opening a fresh store at once otherwise race in its schema migration. Once per process and store."""
    if uri in _READY_STORES or not uri.startswith("sqlite:///"):
        return
    import fcntl

    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - seconds of imports, paid outside the lock
    for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables...": noise to users,
        logging.getLogger(name).setLevel(logging.WARNING)  # and it would precede a refusal's one line
    from mlflow import MlflowClient

    path = Path(uri[len("sqlite:///"):])
    path.parent.mkdir(parents=True, exist_ok=True)
    # The lock lives in the temp folder, keyed by the store's path: nothing is left beside the user's store.
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"workbench-store-{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _retry(lambda: MlflowClient(tracking_uri=uri).search_experiments(max_results=1))
    _READY_STORES.add(uri)


def _plain(method):
    """A store call's failure as a StoreError (one line, MLflow's HTTP status when it gave one): plain enough to
    cross from the worker process, where MLflow's own exception types are not imported."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure of the store reaches the caller as one line
            status = e.get_http_status_code() if hasattr(e, "get_http_status_code") else None
            raise StoreError(" ".join(str(e).split()) or type(e).__name__, status) from None

    return call


class Store:
    """The MLflow calls a job's tracker makes, in plain values (ids, flags, dicts) and plain errors (StoreError), so
    that they run the same in this process or in a worker process (:class:`WorkerStore`)."""

    def __init__(self, uri: str):
        self.uri = uri
        self._client = None

    @property
    def client(self):
        """Made on first use: opening a SQLite store creates it, which a refused config must not do."""
        if self._client is None:
            from mlflow import MlflowClient

            init_store(self.uri)
            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    @_plain
    def experiment_id(self, name: str) -> str:
        def get_or_create() -> str:
            exp = self.client.get_experiment_by_name(name)
            if exp is not None:
                return exp.experiment_id
            try:
                return self.client.create_experiment(name)
            except Exception:  # noqa: BLE001 - a concurrent point created it first
                exp = self.client.get_experiment_by_name(name)
                if exp is None:
                    raise
                return exp.experiment_id

        return _retry(get_or_create)

    @_plain
    def create_run(self, experiment_id: str, run_name: str | None, tags: dict[str, str]) -> str:
        return _retry(lambda: self.client.create_run(experiment_id, run_name=run_name, tags=tags)).info.run_id

    @_plain
    def set_status(self, run_id: str, status: str) -> None:
        _retry(lambda: self.client.update_run(run_id, status=status))

    @_plain
    def status(self, run_id: str) -> str:
        return _retry(lambda: self.client.get_run(run_id)).info.status

    @_plain
    def has_params(self, run_id: str) -> bool:
        return bool(_retry(lambda: self.client.get_run(run_id)).data.params)

    @_plain
    def logged_until(self, run_id: str) -> dict[str, int]:
        return logged_until(self.client, run_id)

    @_plain
    def send(self, run_id: str, op: tuple) -> None:
        send(self.client, run_id, op)


STORE_CALLS = ("experiment_id", "create_run", "set_status", "status", "has_params", "logged_until", "send")


class WorkerStore:
    """A :class:`Store` in a worker process (``python -m workbench.tracking serve <uri>``): MLflow's imports and its
    store open on another core while this process starts and trains. Calls go one at a time, pickled over the worker's
    stdin and stdout; a worker that died is replaced at the next call."""

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
    here = str(Path(__file__).resolve().parent.parent)  # the worker imports this very workbench
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


def reachable(uri: str) -> str | None:
    """Why a server at `uri` cannot be reached (one line), found by a TCP connection within CHECK_TIMEOUT seconds and
    without MLflow; None for a reachable server and for stores that are not servers (SQLite: a path, checked by
    uri_problem)."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return None
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        with socket.create_connection((parsed.hostname or "localhost", port), timeout=CHECK_TIMEOUT):
            return None
    except socket.timeout:
        return f"tracking.uri={uri!r} did not answer within {CHECK_TIMEOUT:.0f} s"
    except (OSError, ValueError) as e:
        reason = f"[Errno {e.errno}] {e.strerror}" if getattr(e, "errno", None) else str(e)
        return f"tracking.uri={uri!r} cannot be used: {reason}"


SWEEP_FILE = ".workbench-sweep.json"  # in a sweep's folder: its parent run, written by the multirun driver


def sweep_parent(sweep_dir: str | Path) -> str | None:
    """The parent run id that the sweep's driver made (see workbench.sweep); None, with a warning, if it made none."""
    import json

    try:
        return json.loads((Path(sweep_dir) / SWEEP_FILE).read_text())["parent_run_id"]
    except (OSError, ValueError, KeyError):
        log.warning("no parent run for sweep folder %s (the multirun driver makes it): this run is not grouped",
                    sweep_dir)
        return None


class NullTracker:
    """What every rank but 0 (and tracking.enabled=false) gets."""

    run_id: str | None = None
    uri: str | None = None
    spooled: Path | None = None  # where unsent tracking calls went, when the server was away at the end

    def check(self) -> str | None: ...
    def settle(self) -> None: ...
    def start(self, *args, **kwargs) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...
    def log_many(self, lines) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_figure(self, figure, name: str) -> None: ...
    def log_curves(self, history, name: str = "training_curves.png") -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...
    def finish_if_running(self, status: str) -> None: ...
    def flush(self) -> None: ...


# MLflow's HTTP client retries each call for minutes by default; our outbox retries instead, in the background, so
# one call against a dead server fails within seconds. A user's own setting wins.
FAST_FAIL_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
CHECK_TIMEOUT = 10.0  # seconds: an unreachable store is refused within this, before any work
FLUSH_WAIT = 2.0  # seconds a checkpoint waits for a live server to take the queued lines (then they go to disk)
URI_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc", "file")


def uri_problem(uri: str) -> str | None:
    """Why MLflow cannot use `uri`, found without contacting it; None when it looks usable."""
    from urllib.parse import urlparse

    try:
        parsed = urlparse(uri)
    except ValueError as e:
        return f"tracking.uri={uri!r} is not a URI ({e})"
    scheme = parsed.scheme.split("+")[0]
    if scheme not in URI_SCHEMES:
        return (f"tracking.uri={uri!r} is not a tracking URI MLflow can use; give sqlite:///<path>/mlflow.db or "
                "http(s)://<host>:<port>")
    if scheme == "sqlite" and uri != "sqlite://":  # sqlite:///<path>; MLflow would create a mistyped folder
        folder = Path(uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else parsed.path).parent
        if not folder.is_dir():
            return f"tracking.uri={uri!r}: the folder {str(folder)!r} does not exist; create it or fix the path"
    return None


def _creates_store(uri: str) -> bool:
    """Whether opening `uri` would create its SQLite file: a job refused by its pre-run checks must leave none."""
    return uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists()


class _Background:
    """``fn()`` on a daemon thread; :meth:`result` waits for it and returns its value or raises its error."""

    def __init__(self, fn):
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="workbench-tracking-setup", daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # noqa: BLE001 - raised where the result is asked for
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class MlflowTracker(NullTracker):
    """One MLflow run. Set-up calls (experiment, run, resume bookkeeping) are made directly; every write after
    :meth:`start` goes through the :class:`~workbench.outbox.Outbox`, so a dead server never stalls training.
    ``worker=True``: MLflow runs in a worker process (:class:`WorkerStore`), off this process's core."""

    def __init__(self, cfg: DictConfig, worker: bool = False):
        for key, value in FAST_FAIL_ENV.items():
            os.environ.setdefault(key, value)
        self.cfg = cfg
        self.uri = tracking_uri(cfg.tracking.uri)
        # Found before a client exists (it would raise a traceback, or create a store); reported by check().
        self.problem = uri_problem(self.uri)
        self.store = WorkerStore(self.uri) if worker and not self.problem else Store(self.uri)
        self.run_id = None
        self._experiment: _Background | None = None  # the experiment's id, looked up while the job builds
        self.spooled = None
        self.outbox: Outbox | None = None
        self._own_folder: str | None = None  # a tracker used on its own (no output_dir): a temp folder, made on use
        self._spool_files: list[Path] = []  # this run's spool files on disk (written or replayed by this tracker)
        self.logged_until = {"loss": -1, "steps": -1, "eval_loss": -1}

    @property
    def run_folder(self) -> str:
        """Where staged artifacts and the spool live: the run folder, read when needed, not when the tracker is made
        (a job makes its tracker before it knows its run folder; a spool elsewhere is one the closing line's sync
        command cannot find, nor a resumed run replay). A tracker used on its own gets a temporary folder."""
        if self.cfg.get("output_dir"):
            return str(self.cfg.output_dir)
        if self._own_folder is None:
            self._own_folder = tempfile.mkdtemp(prefix="workbench-tracking-")
        return self._own_folder

    @property
    def client(self):
        """MLflow's own client, in this process (a sweep's driver uses it directly)."""
        return self.store.client

    def check(self) -> str | None:
        """Why this run cannot be tracked (one line), found within CHECK_TIMEOUT seconds; None when it can.

        Malformed and unreachable stores are found here without MLflow; the experiment is then looked up (or made) on
        a background thread while the job builds, and what goes wrong there is raised by :meth:`start`."""
        if not str(self.cfg.tracking.experiment_name or "").strip():  # checked before any store is opened
            return "tracking.experiment_name must not be empty"
        problem = self.problem or reachable(self.uri)
        if problem:
            return problem
        if not _creates_store(self.uri):  # a fresh SQLite file is made by start(), after the job's own checks
            self._experiment = _Background(self._experiment_id)
        return None

    def settle(self) -> None:
        """Wait for the lookup check() began (its error is start()'s to raise): a job refused meanwhile leaves the
        store whole, never in the middle of a write."""
        if self._experiment is not None:
            try:
                self._experiment.result()
            except Exception:  # noqa: BLE001
                pass

    def _experiment_id(self) -> str:
        try:
            return self.store.experiment_id(self.cfg.tracking.experiment_name)
        except StoreError as e:
            errno = re.search(r"\[Errno -?\d+\] [^'\")]+", str(e))  # a connection error: its OS reason says it all
            raise WorkbenchError(f"tracking.uri={self.uri!r} cannot be used: "
                                 f"{errno.group(0) if errno else str(e)[:300]}") from None

    def start(self, tags: Mapping[str, Any], run_id: str | None = None, sweep_dir: str | None = None,
              pending: bool = False) -> None:
        """Start a run, or continue `run_id` (created at submission, or the run of a resumed checkpoint).

        The resolved config goes in as params and as an artifact, once. Inside a multirun sweep the run is a child of
        the sweep's parent run. `pending`: created by a launcher before its job starts (status SCHEDULED).
        What the store refuses is raised as one line (WorkbenchError); a run it made is then ended FAILED.
        """
        try:
            self._start(tags, run_id, sweep_dir, pending)
        except StoreError as e:
            message = f"tracking.uri={self.uri!r} cannot be used: {str(e)[:300]}"
            if self.run_id is not None:  # made, then refused: never left RUNNING
                self.set_tags({"error": message})
                self.finish("FAILED")
                self.run_id = None
            raise WorkbenchError(message) from None

    def _start(self, tags: Mapping[str, Any], run_id: str | None, sweep_dir: str | None, pending: bool) -> None:
        experiment_id = self._experiment.result() if self._experiment is not None else self._experiment_id()
        all_tags = {k: scrub(str(v)) for k, v in tags.items() if v is not None}
        if run_id is None:
            parent = sweep_parent(sweep_dir) if sweep_dir else None
            if parent is not None:
                all_tags[PARENT_TAG] = parent
            run_id = self.store.create_run(experiment_id, self.cfg.tracking.run_name, all_tags)
            all_tags = {}
        else:
            try:
                self.store.set_status(run_id, "RUNNING")
            except StoreError as e:
                if e.http_status != 404:
                    raise
                raise WorkbenchError(f"MLflow run {run_id} (of the checkpoint or launcher this job continues) is not in "
                                     f"{self.uri}; point tracking.uri at the store that holds it") from None
        self.run_id = run_id
        self.outbox = Outbox(self._send)
        if all_tags:
            self.set_tags(all_tags)
        if pending:
            self.store.set_status(run_id, "SCHEDULED")
            return
        # A resumed run recomputes the steps after its checkpoint (same batches, same noise): log each step once.
        self.logged_until = self.store.logged_until(run_id)
        self._replay_spool()
        if self.store.has_params(run_id):
            return
        container = redacted(self.cfg)
        self._put(("params", {k: str(v)[:6000] for k, v in flatten(container).items()}))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "config.yaml"
            path.write_text(OmegaConf.to_yaml(OmegaConf.create(container)))
            self.log_artifact(path)

    def _send(self, op: tuple) -> None:
        self.store.send(self.run_id, op)

    def _put(self, op: tuple) -> None:
        """Queue a write; a tracker used on an existing run without start() (a sweep's parent) writes at once."""
        if self.outbox is None:
            self._send(op)
        else:
            self.outbox.put(op)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.log_many([(metrics, step)])

    def log_many(self, lines: list[tuple[Mapping[str, float], int | None]]) -> None:
        """Queue several lines (metrics, step); they reach MLflow in order, in as few round trips as it allows."""
        fresh = only_new(lines, self.logged_until)
        if fresh:
            ms = int(time.time() * 1000)
            self._put(("metrics", [[{k: float(v) for k, v in m.items()}, step or 0, ms] for m, step in fresh]))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._put(stage(self.run_folder, path, artifact_path))

    def log_figure(self, figure, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            figure.savefig(Path(tmp) / name)
            self.log_artifact(Path(tmp) / name)

    def log_curves(self, history, name: str = "training_curves.png") -> None:
        """The run's training curves (workbench.plots.training_curves of `history`), drawn where they are sent."""
        self._put(("curves", name, {"steps": list(history.steps), "loss": list(history.loss),
                                    "epsilon": list(history.epsilon), "delta": history.delta}))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._put(("tags", {k: scrub(str(v)) for k, v in tags.items()}))

    def finish(self, status: str = "FINISHED") -> None:
        """End the run: everything queued is sent within tracking.flush_timeout seconds, else spooled to the run
        folder (``self.spooled``) for ``python -m workbench.tracking sync``. Never raises, never hangs."""
        if self.outbox is None:
            self._close_store()
            return
        self._put(("status", status))
        # A killed job has seconds before SIGKILL follows (torchrun, SLURM): spool sooner rather than be cut off.
        self.outbox.drain(self.cfg.tracking.flush_timeout if status == "FINISHED" else min(self.cfg.tracking.flush_timeout, 10))
        unsent = self.outbox.close()
        self._persist(unsent)
        tidy(self.run_folder)
        if self._own_folder is not None and not unsent:  # a temporary folder with nothing left in it goes
            shutil.rmtree(self._own_folder, ignore_errors=True)
        if unsent:
            self.spooled = spool_dir(self.run_folder)
            log.warning("the tracking server did not answer (%s): %d tracking calls spooled to %s; upload them "
                        "with: python -m workbench.tracking sync %s", self.outbox.last_error, len(unsent),
                        self.spooled, self.run_folder)
        self.outbox = None
        self._close_store()

    def _close_store(self) -> None:
        if isinstance(self.store, WorkerStore):
            self.store.close()

    def flush(self) -> None:
        """Before a checkpoint: what is not in MLflow yet is also on disk, so a job killed after the checkpoint loses
        no line (its resumed run sends them). Waits briefly for a live server, not at all for one known away."""
        if self.outbox is not None:
            if self.outbox.last_error is None:
                self.outbox.drain(FLUSH_WAIT)
            self._persist(self.outbox.pending())

    def _persist(self, unsent: list[tuple]) -> None:
        """Make the spool hold exactly `unsent` for this run: a new file first, then the ones it replaces."""
        written = [write_spool(self.run_folder, self.uri, self.run_id, unsent)] if unsent else []
        for old in self._spool_files:
            old.unlink(missing_ok=True)
        self._spool_files = written

    def _replay_spool(self) -> None:
        """A resumed run first sends what its interrupted job had spooled for the same run."""
        for path, head, ops in read_spool(self.run_folder):
            if head["run_id"] != self.run_id or head["uri"] != self.uri:
                continue
            for op in ops:
                if op[0] == "metrics":
                    op = unsent_lines(op, self.logged_until)
                self._put(op)
            self._spool_files.append(path)

    def finish_if_running(self, status: str) -> None:
        """End the run unless its job already ended it (a launcher's view after the job returned)."""
        try:
            running = self.store.status(self.run_id) in ("RUNNING", "SCHEDULED")
        except StoreError:  # server away: end it anyway (spooled if it stays away)
            running = True
        if self.run_id is not None and running:
            self.finish(status)
        else:
            if self.outbox is not None:
                self.outbox.close()
            self._close_store()


def end_if_abandoned(cfg: DictConfig, run_id: str, status: str, grace: float = 5.0) -> None:
    """On a rank other than 0 that is failing: if rank 0 has not ended the run within `grace` seconds (it may have
    been killed outright), end it here. Never raises: the rank's own error is what matters."""
    try:
        for key, value in FAST_FAIL_ENV.items():
            os.environ.setdefault(key, value)
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri(cfg.tracking.uri))
        deadline = time.monotonic() + grace
        while client.get_run(run_id).info.status == "RUNNING":
            if time.monotonic() > deadline:
                client.set_terminated(run_id, status=status)
                return
            time.sleep(0.5)
    except Exception as e:  # noqa: BLE001
        log.debug("could not check the run's status: %s", e)


def logged_until(client, run_id: str) -> dict[str, int]:
    """The newest step already logged for each line key (training log, final summary, periodic eval)."""
    until = {}
    for key in ("loss", "steps", "eval_loss"):
        history = _retry(lambda key=key: client.get_metric_history(run_id, key))
        until[key] = max((m.step for m in history), default=-1)
    return until


def only_new(lines, until: Mapping[str, int]) -> list:
    """The lines a resumed run has not logged yet: each line has a key that identifies it."""
    fresh = []
    for metrics, step in lines:
        key = next((k for k in until if k in metrics), None)
        if key is None or step is None or step > until[key]:
            fresh.append((metrics, step))
    return fresh


def unsent_lines(op: tuple, until: Mapping[str, int]) -> tuple:
    """A spooled metrics operation without the lines the server already has."""
    return ("metrics", [line for line in op[1] if only_new([(line[0], line[1])], until)])


def send(client, run_id: str, op: tuple) -> None:
    """One outbox operation to MLflow (see :mod:`workbench.outbox`)."""
    from mlflow.entities import Metric, Param, RunTag

    kind = op[0]
    if kind == "metrics":
        batch = [Metric(k, v, ms, step) for metrics, step, ms in op[1] for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            _retry(lambda chunk=batch[i:i + 1000]: client.log_batch(run_id, metrics=chunk))
    elif kind == "params":
        params = [Param(k, v) for k, v in op[1].items()]
        for i in range(0, len(params), 100):
            _retry(lambda chunk=params[i:i + 100]: client.log_batch(run_id, params=chunk))
    elif kind == "tags":
        _retry(lambda: client.log_batch(run_id, tags=[RunTag(k, v) for k, v in op[1].items()]))
    elif kind == "artifact":
        client.log_artifact(run_id, op[1], op[2])
        unstage(op)
    elif kind == "curves":
        from types import SimpleNamespace

        from workbench.plots import training_curves

        with tempfile.TemporaryDirectory() as tmp:
            training_curves(SimpleNamespace(**op[2])).savefig(Path(tmp) / op[1])
            client.log_artifact(run_id, str(Path(tmp) / op[1]))
    elif kind == "status":  # the tag too: a launcher's run was tagged status=submitted at submission
        _retry(lambda: client.set_tag(run_id, "status", op[1].lower()))
        _retry(lambda: client.set_terminated(run_id, status=op[1]))
    else:
        raise ValueError(f"unknown tracking operation {kind!r}")


def sync(output_dir: str | Path, uri: str | None = None) -> int:
    """Upload a run folder's spooled tracking calls into their run (at `uri` when the server moved); returns how many
    were sent."""
    from mlflow import MlflowClient

    spooled = read_spool(output_dir)
    if not spooled:
        raise WorkbenchError(f"{str(output_dir)!r} has nothing spooled (no {spool_dir(output_dir)})")
    for key, value in FAST_FAIL_ENV.items():
        os.environ.setdefault(key, value)
    count = 0
    for path, head, ops in spooled:
        head["uri"] = uri or head["uri"]
        client = MlflowClient(tracking_uri=head["uri"])
        try:
            until = logged_until(client, head["run_id"])
            for i, op in enumerate(ops):
                if op[0] == "metrics":  # a line that reached the server before the spool was written goes once
                    op = unsent_lines(op, until)
                if op[0] != "metrics" or op[1]:
                    send(client, head["run_id"], op)
                count += 1
        except Exception as e:  # noqa: BLE001 - keep what is left for the next try
            write_spool(output_dir, head["uri"], head["run_id"], ops[i:])
            path.unlink()
            message = " ".join(str(e).split())[:300]
            raise WorkbenchError(f"sync stopped after {count} tracking calls ({head['uri']}: {message}); "
                                 "the rest stays spooled, run sync again") from None
        path.unlink()
    tidy(output_dir)
    return count


def make_tracker(cfg: DictConfig, is_main: bool) -> NullTracker:
    if not (cfg.tracking.enabled and is_main):
        return NullTracker()
    try:
        # A process that has MLflow imported already (a notebook, a test) keeps it in process: a worker would only
        # import it again. A job started from the CLI has not: its worker imports it on another core.
        return MlflowTracker(cfg, worker="mlflow" not in sys.modules)
    except ImportError as e:
        raise WorkbenchError(f"tracking needs mlflow: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """``python -m workbench.tracking sync <run folder>``: upload what a run spooled while its server was away."""
    import argparse

    if argv is None and sys.argv[1:2] == ["serve"]:  # a job's tracking worker (WorkerStore), not a user command
        serve(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(prog="python -m workbench.tracking")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("sync", help="upload what a run spooled while its tracking server was away")
    command.add_argument("run_folder")
    command.add_argument("--tracking-uri", help="the server's address now, when it moved since the run")
    args = parser.parse_args(argv)
    try:
        count = sync(args.run_folder, args.tracking_uri)
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"synced {count} tracking calls from {args.run_folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
