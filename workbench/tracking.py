"""Rank-zero MLflow tracking: one run per job, ended FINISHED or FAILED, never left RUNNING.

Only world rank 0 talks to MLflow; every other rank gets a :class:`NullTracker` with the same methods.
"""

from __future__ import annotations

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

    def _sweep_parent(self, experiment_id: str, sweep_dir: str) -> str:
        """The parent run of a multirun sweep, keyed by its folder. Points started at once may each create one:
        every point then adopts the oldest and the others are deleted, so a sweep always has exactly one parent."""
        query = f"tags.`{SWEEP_TAG}` = '{sweep_dir}' and tags.`workbench.role` = 'sweep'"

        def parents():
            return _retry(lambda: self.client.search_runs([experiment_id], query, order_by=["attributes.start_time ASC"]))

        found = parents()
        if not found:
            name = f"sweep {Path(sweep_dir).parent.name}/{Path(sweep_dir).name}"
            mine = _retry(lambda: self.client.create_run(experiment_id, run_name=name,
                                                         tags={SWEEP_TAG: sweep_dir, "workbench.role": "sweep"}))
            # A parent only groups its children: it is never left RUNNING.
            _retry(lambda: self.client.set_terminated(mine.info.run_id, status="FINISHED"))
            found = parents()
            winner = min(found, key=lambda r: (r.info.start_time, r.info.run_id))
            if winner.info.run_id != mine.info.run_id:
                _retry(lambda: self.client.delete_run(mine.info.run_id))
            return winner.info.run_id
        return min(found, key=lambda r: (r.info.start_time, r.info.run_id)).info.run_id

    def start(self, tags: Mapping[str, Any], run_id: str | None = None, sweep_dir: str | None = None,
              pending: bool = False) -> None:
        """Start a run, or continue `run_id` (created at submission, or the run of a resumed checkpoint).

        The resolved config goes in as params and as an artifact, once. Inside a multirun sweep the run is a child of
        the sweep's parent run. `pending`: created by a launcher before its job starts (status SCHEDULED).
        """
        experiment_id = self._experiment_id()
        all_tags = {k: scrub(str(v)) for k, v in tags.items() if v is not None}
        if run_id is None:
            if sweep_dir:
                all_tags[PARENT_TAG] = self._sweep_parent(experiment_id, sweep_dir)
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
            _retry(lambda k=k, v=v: self.client.set_tag(self.run_id, k, scrub(str(v))))

    def finish(self, status: str = "FINISHED") -> None:
        if self.run_id is not None:
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
