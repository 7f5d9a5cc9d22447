"""Rank-zero MLflow tracking: one run per job, ended FINISHED or FAILED, never left RUNNING.

Only world rank 0 talks to MLflow; every other rank gets a :class:`NullTracker` with the same methods. A job's tracker
talks to MLflow through a worker process (:class:`~workbench.tracking.worker.WorkerStore`): importing MLflow and
opening its store take seconds of CPU, which the worker spends on another core while the job starts and trains.
Every write after the run starts goes through the :class:`~workbench.tracking.outbox.Outbox`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from workbench.errors import WorkbenchError
from workbench.tracking.outbox import (Outbox, StoreError, only_new, read_spool, spool_dir, stage, tidy, unsent_lines,
                                       write_spool)
from workbench.tracking.redaction import flatten, redacted, scrub
from workbench.tracking.runs import PARENT_TAG, sweep_parent
from workbench.tracking.store import Store
from workbench.tracking.uris import FAST_FAIL_ENV, _creates_store, reachable, tracking_uri, uri_problem
from workbench.tracking.worker import WorkerStore

log = logging.getLogger("workbench.tracking")  # the name its lines have always been logged under

FLUSH_WAIT = 2.0  # seconds a checkpoint waits for a live server to take the queued lines (then they go to disk)


class NullTracker:
    """What every rank but 0 (and tracking.enabled=false) gets."""

    run_id: str | None = None
    experiment_id: str | None = None
    uri: str | None = None
    spooled: Path | None = None  # where unsent tracking calls went, when the server was away at the end

    def check(self) -> str | None: ...
    def settle(self) -> None: ...
    def start(self, *args, **kwargs) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...
    def log_many(self, lines) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_figure(self, figure, name: str) -> None: ...
    def log_curves(self, history, name: str = "training_curves.png", unit: str = "example") -> None: ...
    def log_plot(self, plot: str, name: str, data: Mapping[str, Any]) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def log_model(self, path: str | Path, meta: Mapping[str, Any]) -> None: ...
    def log_dataset(self, info: Mapping[str, Any]) -> None: ...
    def log_system_metrics(self, interval: float) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...
    def finish_if_running(self, status: str) -> None: ...
    def flush(self) -> None: ...


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
    :meth:`start` goes through the :class:`~workbench.tracking.outbox.Outbox`, so a dead server never stalls
    training. ``worker=True``: MLflow runs in a worker process (:class:`~workbench.tracking.worker.WorkerStore`), off
    this process's core."""

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
        self.logged_until: dict[str, int] = {}  # metric name -> newest step logged (only_new); a resumed run's: the store's
        self._logging = threading.Lock()  # lines come from the step logger's thread and the training thread

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
        if run_id is not None and _creates_store(self.uri):  # refused before opening it: no store is left behind
            raise WorkbenchError(_not_in(run_id, self.uri))
        experiment_id = self._experiment.result() if self._experiment is not None else self._experiment_id()
        all_tags = {k: scrub(str(v), self._secret) for k, v in tags.items() if v is not None}
        if run_id is None:
            parent = sweep_parent(sweep_dir) if sweep_dir else None
            if parent is not None:
                all_tags[PARENT_TAG] = parent
            name = self.cfg.tracking.run_name
            run_id = self.store.create_run(experiment_id, None if name is None else scrub(str(name), self._secret),
                                           all_tags)
            all_tags = {}
        else:
            try:
                self.store.set_status(run_id, "RUNNING")
            except StoreError as e:
                if e.http_status != 404:
                    raise
                raise WorkbenchError(_not_in(run_id, self.uri)) from None
        self.run_id, self.experiment_id = run_id, experiment_id
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
        with self._logging:
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

    def log_curves(self, history, name: str = "training_curves.png", unit: str = "example") -> None:
        """The run's training curves (workbench.plots.training_curves of `history`), drawn where they are sent; the
        loss only where the run published it, epsilon labelled per user for ``unit="user"``."""
        loss = list(history.loss) if history.loss_published else [float("nan")] * len(history.steps)
        self.log_plot("training_curves", name, {"steps": list(history.steps), "loss": loss,
                                                "epsilon": list(history.epsilon), "delta": history.delta,
                                                **({"unit": unit} if unit != "example" else {})})

    def log_plot(self, plot: str, name: str, data: Mapping[str, Any]) -> None:
        """A figure of workbench.plots (``plots.FIGURES[plot](**data)``, JSON data) drawn where it is sent, so that
        matplotlib stays out of the training process; logged as the artifact `name`."""
        self._put(("curves", name, dict(data), plot))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._put(("tags", {k: scrub(str(v), self._secret) for k, v in tags.items()}))

    @property
    def _secret(self) -> Any:
        """The pinned privacy.secure_seed (None: a fresh secret per run, which nothing here ever sees)."""
        privacy = self.cfg.get("privacy") if hasattr(self.cfg, "get") else None
        return privacy.get("secure_seed") if privacy is not None else None

    def log_model(self, path: str | Path, meta: Mapping[str, Any]) -> None:
        """A pickled ``torch.nn.Module`` at `path`, logged as the run's MLflow model where the store runs (MLflow and
        its model code stay out of this process); `meta`: name, step, privacy (its metadata and tags), register."""
        staged = stage(self.run_folder, path, None)
        self._put(("model", staged[1], dict(meta)))

    def log_dataset(self, info: Mapping[str, Any]) -> None:
        """A run input from metadata only (workbench.tracking.store.log_dataset says which)."""
        self._put(("dataset", dict(info)))

    def log_system_metrics(self, interval: float) -> None:
        """MLflow's system-metrics sampler, every `interval` seconds, where the store runs (the worker process of a CLI
        job, else a thread of this one): never on the training thread."""
        if interval > 0:
            self._put(("system_metrics", float(interval)))

    def finish(self, status: str = "FINISHED") -> None:
        """End the run: everything queued is sent, else spooled to the run folder (``self.spooled``) for
        ``python -m workbench.tracking sync`` once the store has not answered for tracking.flush_timeout seconds (a
        killed job: at most 10 seconds in all). Never raises, never hangs."""
        if self.outbox is None:
            self._close_store()
            return
        self._put(("status", status))
        # A killed job has seconds before SIGKILL follows (torchrun, SLURM): spool sooner rather than be cut off.
        if status == "FINISHED":  # a slow store that answers is waited for (a loaded machine, a large model)
            self.outbox.drain(self.cfg.tracking.flush_timeout, stalled=True)
        else:
            self.outbox.drain(min(self.cfg.tracking.flush_timeout, 10))
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
                    op = unsent_lines(op, self.logged_until)  # recorded: the steps recomputed next are not sent again
                if op[0] != "metrics" or op[1]:
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


def _not_in(run_id: str, uri: str) -> str:
    return (f"MLflow run {run_id} (of the checkpoint or launcher this job continues) is not in {uri}; point "
            "tracking.uri at the store that holds it")


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


def make_tracker(cfg: DictConfig, is_main: bool) -> NullTracker:
    if not (cfg.tracking.enabled and is_main):
        return NullTracker()
    try:
        # A process that has MLflow imported already (a notebook, a test) keeps it in process: a worker would only
        # import it again. A job started from the CLI has not: its worker imports it on another core.
        return MlflowTracker(cfg, worker="mlflow" not in sys.modules)
    except ImportError as e:
        raise WorkbenchError(f"tracking needs mlflow: {e}") from None
