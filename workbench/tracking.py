"""Rank-zero MLflow tracking: one run per job, ended FINISHED or FAILED, never left RUNNING.

Only world rank 0 talks to MLflow; every other rank gets a :class:`NullTracker` with the same methods.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from workbench.errors import WorkbenchError
from workbench.outbox import Outbox, read_spool, spool_dir, stage, tidy, unstage, write_spool

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
    def start(self, *args, **kwargs) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...
    def log_many(self, lines) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_figure(self, figure, name: str) -> None: ...
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


class MlflowTracker(NullTracker):
    """One MLflow run. Set-up calls (experiment, run, resume bookkeeping) are made directly; every write after
    :meth:`start` goes through the :class:`~workbench.outbox.Outbox`, so a dead server never stalls training."""

    def __init__(self, cfg: DictConfig):
        import mlflow

        for key, value in FAST_FAIL_ENV.items():
            os.environ.setdefault(key, value)
        self.mlflow = mlflow
        self.cfg = cfg
        self.uri = tracking_uri(cfg.tracking.uri)
        # Found before a client exists (it would raise a traceback, or create a store); reported by check().
        self.problem = uri_problem(self.uri)
        self._client = None
        self.run_id = None
        self.spooled = None
        self.outbox: Outbox | None = None
        # Staged artifacts and the spool live in the run folder (a temporary one for a tracker used on its own).
        self.run_folder = cfg.get("output_dir") or tempfile.mkdtemp(prefix="workbench-tracking-")
        self._spool_files: list[Path] = []  # this run's spool files on disk (written or replayed by this tracker)
        self.logged_until = {"loss": -1, "steps": -1, "eval_loss": -1}

    @property
    def client(self):
        """Made on first use: opening a SQLite store creates it, which a refused config must not do."""
        if self._client is None:
            init_store(self.uri)
            self._client = self.mlflow.MlflowClient(tracking_uri=self.uri)
        return self._client

    def check(self) -> str | None:
        """Why this run cannot be tracked (one line), found within CHECK_TIMEOUT seconds; None when it can."""
        import threading

        if not str(self.cfg.tracking.experiment_name or "").strip():  # checked before any store is opened
            return "tracking.experiment_name must not be empty"
        if self.problem:
            return self.problem
        answer: list[str | None] = []

        def probe() -> None:
            try:
                self._experiment_id()
                answer.append(None)
            except Exception as e:  # noqa: BLE001 - reported as one line
                answer.append(" ".join(str(e).split()) or type(e).__name__)

        thread = threading.Thread(target=probe, name="workbench-tracking-check", daemon=True)
        thread.start()
        thread.join(CHECK_TIMEOUT)
        if not answer:
            return f"tracking.uri={self.uri!r} did not answer within {CHECK_TIMEOUT:.0f} s"
        if answer[0] is not None:
            errno = re.search(r"\[Errno -?\d+\] [^'\")]+", answer[0])  # a connection error: its OS reason says it all
            return f"tracking.uri={self.uri!r} cannot be used: {errno.group(0) if errno else answer[0][:300]}"
        return None

    def _experiment_id(self) -> str:
        name = self.cfg.tracking.experiment_name

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

    def start(self, tags: Mapping[str, Any], run_id: str | None = None, sweep_dir: str | None = None,
              pending: bool = False) -> None:
        """Start a run, or continue `run_id` (created at submission, or the run of a resumed checkpoint).

        The resolved config goes in as params and as an artifact, once. Inside a multirun sweep the run is a child of
        the sweep's parent run. `pending`: created by a launcher before its job starts (status SCHEDULED).
        """
        self.outbox = Outbox(self._send)
        experiment_id = self._experiment_id()
        all_tags = {k: scrub(str(v)) for k, v in tags.items() if v is not None}
        if run_id is None:
            parent = sweep_parent(sweep_dir) if sweep_dir else None
            if parent is not None:
                all_tags[PARENT_TAG] = parent
            run = _retry(lambda: self.client.create_run(experiment_id, run_name=self.cfg.tracking.run_name, tags=all_tags))
            run_id = run.info.run_id
            self.run_id = run_id
        else:
            self.run_id = run_id
            try:
                _retry(lambda: self.client.update_run(run_id, status="RUNNING"))
            except self.mlflow.exceptions.MlflowException as e:
                if e.get_http_status_code() != 404:
                    raise
                self.outbox.close()
                self.outbox = None
                raise WorkbenchError(f"MLflow run {run_id} (of the checkpoint or launcher this job continues) is not in "
                                     f"{self.uri}; point tracking.uri at the store that holds it") from None
            self.set_tags(all_tags)
        if pending:
            _retry(lambda: self.client.update_run(run_id, status="SCHEDULED"))
            return
        # A resumed run recomputes the steps after its checkpoint (same batches, same noise): log each step once.
        self.logged_until = logged_until(self.client, run_id)
        self._replay_spool()
        if _retry(lambda: self.client.get_run(run_id)).data.params:
            return
        container = redacted(self.cfg)
        self._put(("params", {k: str(v)[:6000] for k, v in flatten(container).items()}))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "config.yaml"
            path.write_text(OmegaConf.to_yaml(OmegaConf.create(container)))
            self.log_artifact(path)

    def _send(self, op: tuple) -> None:
        send(self.client, self.run_id, op)

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

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._put(("tags", {k: scrub(str(v)) for k, v in tags.items()}))

    def finish(self, status: str = "FINISHED") -> None:
        """End the run: everything queued is sent within tracking.flush_timeout seconds, else spooled to the run
        folder (``self.spooled``) for ``python -m workbench.tracking sync``. Never raises, never hangs."""
        if self.outbox is None:
            return
        self._put(("status", status))
        # A killed job has seconds before SIGKILL follows (torchrun, SLURM): spool sooner rather than be cut off.
        self.outbox.drain(self.cfg.tracking.flush_timeout if status == "FINISHED" else min(self.cfg.tracking.flush_timeout, 10))
        unsent = self.outbox.close()
        self._persist(unsent)
        tidy(self.run_folder)
        if unsent:
            self.spooled = spool_dir(self.run_folder)
            log.warning("the tracking server did not answer (%s): %d tracking calls spooled to %s; upload them "
                        "with: python -m workbench.tracking sync %s", self.outbox.last_error, len(unsent),
                        self.spooled, self.run_folder)
        self.outbox = None

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
            running = _retry(lambda: self.client.get_run(self.run_id)).info.status in ("RUNNING", "SCHEDULED")
        except Exception:  # noqa: BLE001 - server away: end it anyway (spooled if it stays away)
            running = True
        if self.run_id is not None and running:
            self.finish(status)
        elif self.outbox is not None:
            self.outbox.close()


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
        return MlflowTracker(cfg)
    except ImportError as e:
        raise WorkbenchError(f"tracking needs mlflow: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """``python -m workbench.tracking sync <run folder>``: upload what a run spooled while its server was away."""
    import sys

    import argparse

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
