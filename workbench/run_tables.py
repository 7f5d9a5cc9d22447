"""MLflow runs read back as tables (pandas DataFrames): every run, one sweep's runs, a sweep's summary, a run's epsilon.

Below the sweep driver and the notebook helpers, which both read runs: the driver summarises its sweep from
:func:`sweep_frame` (workbench/sweep/), the notebook re-exports these (workbench/explore.py).
"""

from __future__ import annotations

import tempfile
from typing import Any

from workbench.tracking.runs import PARENT_TAG
from workbench.tracking.uris import tracking_uri as resolve_uri


def mlflow_client(tracking_uri: str | None):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=resolve_uri(tracking_uri))


def _numeric(column):
    """A params column as numbers when every value is one or "None" (MLflow stores params as strings)."""
    import pandas as pd

    present = column.notna() & (column != "None")  # a null config value is logged as "None"
    converted = pd.to_numeric(column.where(present), errors="coerce")
    return converted if present.any() and converted.notna().sum() == present.sum() else column


def runs_frame(experiment_name: str | None = None, parent_run_id: str | None = None, tracking_uri: str | None = None,
               include_sweeps: bool = False):
    """One row per MLflow run, oldest first: run_id, run_name, status, start_time, end_time, parent_run_id, the
    final value of every metric (epsilon, delta, noise_multiplier, sample_rate, steps, eval_accuracy, ...),
    ``params.<dotted config key>`` and ``tags.<tag>`` (backend, world_size, overrides, hydra choices...).

    `experiment_name`: that experiment only (else every experiment); `parent_run_id`: that sweep's runs only.
    Sweep parent runs themselves are left out unless `include_sweeps`. `tracking_uri` as in the config:
    None means $MLFLOW_TRACKING_URI, else ./mlflow.db."""
    import pandas as pd

    client = mlflow_client(tracking_uri)
    if experiment_name is not None:
        experiment = client.get_experiment_by_name(experiment_name)
        if experiment is None:
            raise ValueError(f"no MLflow experiment named {experiment_name!r} at {resolve_uri(tracking_uri)}")
        experiment_ids = [experiment.experiment_id]
    elif parent_run_id is not None:
        experiment_ids = [client.get_run(parent_run_id).info.experiment_id]
    else:
        experiment_ids = [e.experiment_id for e in client.search_experiments()]
    query = f"tags.`{PARENT_TAG}` = '{parent_run_id}'" if parent_run_id else ""
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, query, order_by=["attributes.start_time ASC"], max_results=1000,
                                  page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    rows = []
    for run in runs:
        tags = run.data.tags
        role = tags.get("workbench.role", "run")
        if role == "sweep" and not include_sweeps:
            continue
        rows.append({"run_id": run.info.run_id, "run_name": run.info.run_name, "status": run.info.status,
                     "start_time": pd.to_datetime(run.info.start_time, unit="ms"),
                     "end_time": pd.to_datetime(run.info.end_time, unit="ms") if run.info.end_time else pd.NaT,
                     "experiment_id": run.info.experiment_id, "parent_run_id": tags.get(PARENT_TAG), "role": role,
                     **run.data.metrics,
                     **{f"params.{k}": v for k, v in sorted(run.data.params.items())},
                     **{f"tags.{k}": v for k, v in sorted(tags.items()) if not k.startswith("mlflow.")}})
    base = ["run_id", "run_name", "status", "start_time", "end_time", "experiment_id", "parent_run_id", "role"]
    df = pd.DataFrame(rows, columns=None if rows else base)
    for name in df.columns:
        if name.startswith("params."):
            df[name] = _numeric(df[name])
    return df.sort_values("start_time", kind="stable").reset_index(drop=True)


def sweep_frame(parent_run_id: str, tracking_uri: str | None = None):
    """The runs of one sweep (children of `parent_run_id`): :func:`runs_frame` restricted to them."""
    return runs_frame(parent_run_id=parent_run_id, tracking_uri=tracking_uri)


def sweep_summary(parent_run_id: str, tracking_uri: str | None = None) -> dict[str, Any]:
    """What a sweep's parent run reports (workbench/sweep/): its metrics (points, points_finished, points_failed,
    best_<metric>, sweep_epsilon_all, sweep_delta, sweep_epsilon_best...), its best-point tags, ``notes`` (why a bound
    may not apply) and ``table``, the ``sweep_table.csv`` artifact as a DataFrame (one row per point)."""
    import pandas as pd

    client = mlflow_client(tracking_uri)
    run = client.get_run(parent_run_id)
    with tempfile.TemporaryDirectory() as tmp:
        table = pd.read_csv(client.download_artifacts(parent_run_id, "sweep_table.csv", tmp))
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("best_")}
    return {**run.data.metrics, **tags, "notes": run.data.tags.get("sweep_notes", ""), "table": table}


def epsilon_curve(run_id: str, tracking_uri: str | None = None):
    """A run's logged history as a DataFrame: step, epsilon, loss. Epsilon is NaN for a non-private run (and on the log
    lines of runs from before every line carried its epsilon)."""
    import pandas as pd

    client = mlflow_client(tracking_uri)
    columns = []
    for key in ("epsilon", "loss"):
        history = client.get_metric_history(run_id, key)
        series = pd.Series({m.step: m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))},
                           name=key, dtype=float)
        columns.append(series)
    df = pd.concat(columns, axis=1).sort_index()
    df.index = df.index.astype(int)
    return df.rename_axis("step").reset_index()
