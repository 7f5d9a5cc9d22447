"""The MLflow store in this process: every call a job's tracker makes, in plain values and plain errors; one outbox
operation written with MLflow's client; a fresh SQLite store created once, under a lock; 'database is locked' retried.

MLflow is imported on first use, never at import: a refused config opens no store, and the training process of a CLI
job leaves MLflow to its worker process (:mod:`workbench.tracking.worker`), which runs this :class:`Store`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from workbench.tracking.outbox import StoreError, unstage
from workbench.tracking.runs import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, TABLE_VIEW_STATE, TABLE_VIEW_TAG

log = logging.getLogger("workbench.tracking")


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
    that they run the same in this process or in a worker process (:class:`~workbench.tracking.worker.WorkerStore`)."""

    def __init__(self, uri: str):
        self.uri = uri
        self._client = None
        self._monitor = None  # MLflow's system-metrics sampler of the run, a thread of this process

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
            if exp is not None:  # made before workbench marked it: a user's kind, or view, stays
                for key, value in ((EXPERIMENT_KIND_TAG, EXPERIMENT_KIND), (TABLE_VIEW_TAG, TABLE_VIEW_STATE)):
                    if key not in exp.tags:
                        self.client.set_experiment_tag(exp.experiment_id, key, value)
                return exp.experiment_id
            try:
                return self.client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND,
                                                                 TABLE_VIEW_TAG: TABLE_VIEW_STATE})
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
        if op[0] == "system_metrics":  # a sampler of this process (the tracking worker's, for a CLI job)
            self._sample_system(run_id, op[1])
            return
        if op[0] == "status":  # the run ends: its sampler logs its last sample first
            self._stop_sampling()
        send(self.client, run_id, op)

    def _sample_system(self, run_id: str, interval: float) -> None:
        """MLflow's own sampler (CPU, memory, disk, network; GPU when pynvml finds one) on a thread of this process:
        never the job's training thread. Prefixed ``system/`` in the run's metrics, as MLflow logs them."""
        self._stop_sampling()
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # its start and stop are INFO lines on the job's stderr: a failed job must still end in one line
            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
            self._monitor = SystemMetricsMonitor(run_id, sampling_interval=interval, tracking_uri=self.uri,
                                                 resume_logging=True)
            self._monitor.start()
        except Exception as e:  # noqa: BLE001 - psutil missing, or a sampler that cannot start: the run goes on
            self._monitor = None
            log.warning("system metrics are not recorded: %s", " ".join(str(e).split())[:300])

    def _stop_sampling(self) -> None:
        if self._monitor is not None:
            monitor, self._monitor = self._monitor, None
            try:
                monitor.finish()
            except Exception as e:  # noqa: BLE001
                log.debug("the system-metrics sampler did not stop cleanly: %s", e)


STORE_CALLS = ("experiment_id", "create_run", "set_status", "status", "has_params", "logged_until", "send")


def logged_until(client, run_id: str) -> dict[str, int]:
    """The newest step already logged for each of the run's metrics (every name, whatever the run publishes)."""
    run = _retry(lambda: client.get_run(run_id))
    # A run's latest metrics (one per name, with its step) are the newest step of each: MLflow orders them by step first
    return {m.key: m.step for m in run.data._metric_objs}


def send(client, run_id: str, op: tuple) -> None:
    """One outbox operation to MLflow (see :mod:`workbench.tracking.outbox`)."""
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
        from workbench.plots import FIGURES

        plot = op[3] if len(op) > 3 else "training_curves"  # a spool written before figures were named
        with tempfile.TemporaryDirectory() as tmp:
            FIGURES[plot](**op[2]).savefig(Path(tmp) / op[1])
            client.log_artifact(run_id, str(Path(tmp) / op[1]))
    elif kind == "model":
        log_model(client, run_id, op[1], op[2])
        unstage(op)
    elif kind == "dataset":
        log_dataset(client, run_id, op[1])
    elif kind == "system_metrics":  # a sampler belongs to a live job's store (Store.send), not to an upload later
        pass
    elif kind == "status":  # the tag too: a launcher's run was tagged status=submitted at submission
        _retry(lambda: client.set_tag(run_id, "status", op[1].lower()))
        _retry(lambda: client.set_terminated(run_id, status=op[1]))
    else:
        raise ValueError(f"unknown tracking operation {kind!r}")


@contextlib.contextmanager
def _tracking_uri_as(uri: str):
    """MLflow's model logging reads the process's tracking URI: `uri` for the duration, and then the process's own
    back as it was, $MLFLOW_TRACKING_URI included (MLflow's own restore drops it: the next job of a sweep run in this
    process would then track into ./mlflow.db)."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    env = os.environ.get("MLFLOW_TRACKING_URI")
    try:
        with _use_tracking_uri(uri):
            yield
    finally:
        if env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env


def log_model(client, run_id: str, path: str, meta: dict) -> None:
    """The trained model (a pickled ``torch.nn.Module``, staged at `path`) as an MLflow model of the run, in the
    ``mlflow.pytorch`` flavour, with the run's privacy budget as its metadata and tags; registered as a new version of
    ``meta["register"]`` with the budget as version tags when asked. No signature and no input example: both would be
    inferred from training data. A model that cannot be read or saved is recorded on the run
    (tag ``workbench.model_error``) and the run goes on; the store being away is raised (the outbox retries)."""
    import mlflow

    privacy = {k: v for k, v in meta.get("privacy", {}).items() if v is not None}
    tags = {f"workbench.{k}": str(v) for k, v in privacy.items()}
    made = None
    try:
        import torch
        import mlflow.pytorch

        model = torch.load(path, map_location="cpu", weights_only=False)
        # its advice on pickle (that loading one runs code) is a line at the end of every job: README says it once
        logging.getLogger("mlflow.pytorch").setLevel(logging.ERROR)
        run = _retry(lambda: client.get_run(run_id))
        if _already_logged(client, run, meta):  # a rerun of a finished run, or the outbox replaying a sent op
            return
        # Made here, in the run's experiment and with the run's source tags: MLflow's own would file it under the
        # process's active experiment, with this (worker) process as its source.
        source = {k: v for k, v in run.data.tags.items() if k.startswith(("mlflow.source.", "mlflow.user"))}
        made = _retry(lambda: client.create_logged_model(run.info.experiment_id, name=meta.get("name", "model"),
                                                         source_run_id=run_id, tags={**source, **tags}))
        with _tracking_uri_as(client.tracking_uri):
            info = mlflow.pytorch.log_model(
                model, name=meta.get("name", "model"), model_id=made.model_id, run_id=run_id,
                step=int(meta.get("step", 0)), metadata={"workbench": privacy},
                serialization_format="pickle",  # pt2 needs an input example
                # Given, so MLflow does not infer them (a subprocess that loads the model: seconds per run).
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
        _retry(lambda: client.finalize_logged_model(made.model_id, "READY"))
    except Exception as e:  # noqa: BLE001 - a model that will not save must not cost the run its other records
        message = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        if made is not None:
            try:
                client.finalize_logged_model(made.model_id, "FAILED")
            except Exception:  # noqa: BLE001
                pass
        _retry(lambda: client.set_tag(run_id, "workbench.model_error", message))  # the store away: raised, retried
        log.warning("the trained model was not logged as an MLflow model: %s", message)
        return
    name = meta.get("register")
    if name:
        try:
            with _tracking_uri_as(client.tracking_uri):
                version = mlflow.register_model(info.model_uri, name, tags=tags)
            _retry(lambda: client.set_tag(run_id, "workbench.registered_model", f"{name}/{version.version}"))
        except Exception as e:  # noqa: BLE001
            message = " ".join(f"{type(e).__name__}: {e}".split())[:500]
            _retry(lambda: client.set_tag(run_id, "workbench.model_error", f"registering {name!r}: {message}"))
            log.warning("the trained model was not registered as %r: %s", name, message)


def _already_logged(client, run, meta: dict) -> bool:
    """Whether the run already holds this model (its name, at its step, READY), and its registration if one is asked:
    logging is then a no-op, so that one model is one MLflow model and one registered version."""
    name, step = meta.get("name", "model"), str(meta.get("privacy", {}).get("steps", meta.get("step", 0)))
    found = _retry(lambda: client.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}' AND name = '{name}'"))
    if not any(str(m.status).endswith("READY") and m.tags.get("workbench.steps") == step for m in found):
        return False
    wanted = meta.get("register")
    return not wanted or run.data.tags.get("workbench.registered_model", "").startswith(f"{wanted}/")


def log_dataset(client, run_id: str, info: dict) -> None:
    """A dataset as a run input (what ``mlflow.log_input`` records), from metadata only: its name, source (the
    config's data target and arguments), digest (of that config and N), N (examples, or users at user level) and, for
    tensor datasets,
    the shapes and dtypes of a row. Never the content."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    schema = None
    if info.get("features"):
        import numpy as np
        from mlflow.types import Schema, TensorSpec

        specs = Schema([TensorSpec(np.dtype(f["dtype"]), tuple([-1, *f["shape"]]), f["name"]) for f in info["features"]])
        schema = json.dumps({"mlflow_tensorspec": {"features": specs.to_json(), "targets": None}})
    dataset = Dataset(name=info["name"], digest=info["digest"], source_type="code",
                      source=json.dumps({"tags": {"workbench.data": info["source"]}}), schema=schema,
                      profile=json.dumps({k: info[k] for k in ("num_examples", "num_users") if k in info}))
    _retry(lambda: client.log_inputs(run_id, datasets=[
        DatasetInput(dataset, tags=[InputTag("mlflow.data.context", info["context"])])]))
