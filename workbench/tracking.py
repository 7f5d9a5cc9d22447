"""Rank-zero MLflow tracking: one run per job, ended FINISHED or FAILED, never left RUNNING.

Only world rank 0 talks to MLflow; every other rank gets a :class:`NullTracker` with the same methods.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from workbench.errors import WorkbenchError

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


def redacted(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as MLflow may show it: a set privacy.secure_seed would let readers undo the privacy."""
    container = OmegaConf.to_container(cfg, resolve=True)
    if container.get("privacy", {}).get("secure_seed") is not None:
        container["privacy"]["secure_seed"] = "<redacted>"
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
    """Create and migrate a SQLite store once, under a file lock beside it, before this process logs anything: processes
    opening a fresh store at once otherwise race in its schema migration. Once per process and store."""
    if uri in _READY_STORES or not uri.startswith("sqlite:///"):
        return
    import fcntl

    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - seconds of imports, paid outside the lock
    from mlflow import MlflowClient

    path = Path(uri[len("sqlite:///"):])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
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

    def start(self, *args, **kwargs) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...
    def log_many(self, lines) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_figure(self, figure, name: str) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...
    def finish_if_running(self, status: str) -> None: ...
    def flush(self) -> None: ...


class MlflowTracker(NullTracker):
    def __init__(self, cfg: DictConfig):
        import mlflow

        self.mlflow = mlflow
        self.cfg = cfg
        self.uri = tracking_uri(cfg.tracking.uri)
        init_store(self.uri)
        self.client = mlflow.MlflowClient(tracking_uri=self.uri)
        self.run_id = None
        self.logged_until = {"loss": -1, "steps": -1, "eval_loss": -1}

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
        experiment_id = self._experiment_id()
        all_tags = {k: str(v) for k, v in tags.items() if v is not None}
        if run_id is None:
            parent = sweep_parent(sweep_dir) if sweep_dir else None
            if parent is not None:
                all_tags[PARENT_TAG] = parent
            run = _retry(lambda: self.client.create_run(experiment_id, run_name=self.cfg.tracking.run_name, tags=all_tags))
            run_id = run.info.run_id
            self.run_id = run_id
        else:
            self.run_id = run_id
            _retry(lambda: self.client.update_run(run_id, status="RUNNING"))
            self.set_tags(all_tags)
        if pending:
            _retry(lambda: self.client.update_run(run_id, status="SCHEDULED"))
            return
        # A resumed run recomputes the steps after its checkpoint (same batches, same noise): log each step once.
        for key in self.logged_until:
            history = _retry(lambda key=key: self.client.get_metric_history(run_id, key))
            self.logged_until[key] = max((m.step for m in history), default=-1)
        if _retry(lambda: self.client.get_run(run_id)).data.params:
            return
        container = redacted(self.cfg)
        params = [self.mlflow.entities.Param(k, str(v)[:6000]) for k, v in flatten(container).items()]
        for i in range(0, len(params), 100):
            _retry(lambda chunk=params[i:i + 100]: self.client.log_batch(self.run_id, params=chunk))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "config.yaml"
            path.write_text(OmegaConf.to_yaml(OmegaConf.create(container)))
            self.log_artifact(path)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.log_many([(metrics, step)])

    def log_many(self, lines: list[tuple[Mapping[str, float], int | None]]) -> None:
        """Log several lines (metrics, step) in as few round trips as MLflow allows (1000 metrics a batch)."""
        ts = int(time.time() * 1000)
        batch = []
        for metrics, step in lines:
            # Each line has a key that identifies it: training log, final summary or periodic eval.
            key = next((k for k in self.logged_until if k in metrics), None)
            if key is not None and step is not None and step <= self.logged_until[key]:
                continue  # logged before the interruption this run resumed from
            batch += [self.mlflow.entities.Metric(k, float(v), ts, step or 0) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            _retry(lambda chunk=batch[i:i + 1000]: self.client.log_batch(self.run_id, metrics=chunk))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_figure(self, figure, name: str) -> None:
        self.client.log_figure(self.run_id, figure, name)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for k, v in tags.items():
            _retry(lambda k=k, v=v: self.client.set_tag(self.run_id, k, str(v)))

    def finish(self, status: str = "FINISHED") -> None:
        if self.run_id is not None:  # the tag too: a launcher's run was tagged status=submitted at submission
            _retry(lambda: self.client.set_tag(self.run_id, "status", status.lower()))
            _retry(lambda: self.client.set_terminated(self.run_id, status=status))

    def finish_if_running(self, status: str) -> None:
        """End the run unless its job already ended it (a launcher's view after the job returned)."""
        if self.run_id is not None and _retry(lambda: self.client.get_run(self.run_id)).info.status in ("RUNNING", "SCHEDULED"):
            self.finish(status)


def make_tracker(cfg: DictConfig, is_main: bool) -> NullTracker:
    if not (cfg.tracking.enabled and is_main):
        return NullTracker()
    try:
        return MlflowTracker(cfg)
    except ImportError as e:
        raise WorkbenchError(f"tracking needs mlflow: {e}") from None
