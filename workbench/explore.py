"""Exploring from a notebook: train on N local processes, sweep, read runs back from MLflow, draw them.

    from workbench import explore
    parent = explore.sweep(explore.DEFAULT_SWEEP)          # epsilon 1, 3, 8 and a non-private baseline
    runs = explore.sweep_frame(parent)                      # one row per run: params.*, final metrics, tags.*
    explore.plot_frontier(runs, "eval_accuracy")            # eval metric vs epsilon, baseline as a line
    explore.plot_epsilon(runs.run_id[0])                    # epsilon and loss vs step of one run
    explore.sweep_summary(parent)                           # the parent's table, best points and sweep_epsilon_all

``python -m workbench.explore frontier --out docs/frontier.png [overrides...]`` redraws the README's picture.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

from omegaconf import DictConfig, open_dict

from workbench.plots import frontier as plot_frontier
from workbench.tracking import PARENT_TAG, tracking_uri as resolve_uri

EPSILONS = (1, 3, 8)
# The non-private baseline needs its own learning rate: SGD at the DP-SGD rate (1.5, tuned for clipped, noised,
# batch-averaged gradients) is unstable without clipping (about 76 % on digits); 0.5 trains well (about 96 %).
BASELINE = ("privacy=none", "learning_rate=0.5")
DEFAULT_SWEEP: tuple[tuple[str, ...], ...] = tuple((f"privacy.target_epsilon={e}",) for e in EPSILONS) + (BASELINE,)

__all__ = ["BASELINE", "DEFAULT_SWEEP", "EPSILONS", "epsilon_curve", "plot_epsilon", "plot_frontier", "runs_frame",
           "summary", "sweep", "sweep_frame", "sweep_summary", "train_local"]


def _figures_render_in_notebooks() -> None:
    """workbench.plots draws on Agg (headless), which leaves IPython without a way to show a returned Figure: register
    its PNG formatter, so that the last expression of a cell shows the picture (no `%matplotlib inline` needed)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None and hasattr(shell, "kernel"):  # a Jupyter kernel, not a terminal IPython
        from IPython.core.pylabtools import select_figure_formats

        select_figure_formats(shell, {"png"})


_figures_render_in_notebooks()


# ---------------------------------------------------------------------------------------------------------- training

def summary(result) -> dict[str, Any]:
    """A TrainResult without the model and history: plain values that travel between processes."""
    return {"metrics": dict(result.metrics), "epsilon": result.epsilon, "delta": result.delta,
            "noise_multiplier": result.noise_multiplier, "sample_rate": result.sample_rate, "steps": result.steps,
            "run_id": result.run_id, "tracking_uri": result.tracking_uri, "output_dir": str(result.output_dir)}


def _train_on_rank(cfg_or_overrides: DictConfig | Sequence[str]) -> dict[str, Any]:
    """What every rank of :func:`train_local` runs: the CLI's own compose and train, inside the rank's process group."""
    from workbench import compose, train

    cfg = cfg_or_overrides if isinstance(cfg_or_overrides, DictConfig) else compose(list(cfg_or_overrides))
    return {**summary(train(cfg)), "world_size": int(os.environ.get("WORLD_SIZE", "1"))}


def train_local(cfg_or_overrides: DictConfig | Sequence[str] = (), nprocs: int = 2, timeout: float = 600) -> dict[str, Any]:
    """Train one config on `nprocs` local processes (one job, one process group, gloo on CPU) and return rank 0's
    :func:`summary`: metrics, epsilon, delta, steps, run_id... `per_device_train_batch_size` is per process."""
    from workbench import launch_distributed

    return launch_distributed(_train_on_rank, nprocs, cfg_or_overrides, timeout=timeout)[0]


def sweep(points: Sequence[Sequence[str]] = DEFAULT_SWEEP, overrides: Sequence[str] = (),
          sweep_dir: str | Path | None = None) -> str | None:
    """Train each point (a list of overrides, after the common `overrides`) in this process, one after the other, as
    child runs of one MLflow parent run, like ``python -m workbench -m ...`` does: the parent is made first and
    summarised at the end (table, frontier, best point, ``sweep_epsilon_all``; see workbench/sweep.py). With
    ``sweep.tuning=random_stopping`` in `overrides`, each point is trained as many times as the random draw says.
    Run folders go under `sweep_dir` (default ``multirun/<date>/<time>``). Returns the parent run id (None with
    tracking off)."""
    from workbench import compose, sweep as sweeps, train

    root = Path(sweep_dir or Path("multirun") / time.strftime("%Y-%m-%d/%H-%M-%S")).resolve()
    state = sweeps.start(compose(list(overrides)), root, points=points,
                         compose_point=lambda point: compose([*overrides, *point]))
    try:
        for i, point in enumerate(points):
            for trial in range(sweeps.trials_for_point(root, i)):
                folder = root / str(i) if trial == 0 else root / f"{i}-trial-{trial}"
                cfg = compose([*overrides, *point, f"output_dir='{folder}'"])
                with open_dict(cfg):
                    cfg.tracking.sweep_dir = str(root)
                    cfg.tracking.tags.setdefault("overrides", " ".join(point))
                train(cfg)
    finally:
        sweeps.finish(root)
    return state["parent_run_id"]


# ------------------------------------------------------------------------------------------------------ reading runs

def _client(tracking_uri: str | None):
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

    client = _client(tracking_uri)
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
    """What a sweep's parent run reports (workbench/sweep.py): its metrics (points, points_finished, points_failed,
    best_<metric>, sweep_epsilon_all, sweep_delta, sweep_epsilon_best...), its best-point tags, ``notes`` (why a bound
    may not apply) and ``table``, the ``sweep_table.csv`` artifact as a DataFrame (one row per point)."""
    import pandas as pd

    client = _client(tracking_uri)
    run = client.get_run(parent_run_id)
    with tempfile.TemporaryDirectory() as tmp:
        table = pd.read_csv(client.download_artifacts(parent_run_id, "sweep_table.csv", tmp))
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("best_")}
    return {**run.data.metrics, **tags, "notes": run.data.tags.get("sweep_notes", ""), "table": table}


def epsilon_curve(run_id: str, tracking_uri: str | None = None):
    """A run's logged history as a DataFrame: step, epsilon, loss. Epsilon is NaN for a non-private run (and on the log
    lines of runs from before every line carried its epsilon)."""
    import pandas as pd

    client = _client(tracking_uri)
    columns = []
    for key in ("epsilon", "loss"):
        history = client.get_metric_history(run_id, key)
        series = pd.Series({m.step: m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))},
                           name=key, dtype=float)
        columns.append(series)
    df = pd.concat(columns, axis=1).sort_index()
    df.index = df.index.astype(int)
    return df.rename_axis("step").reset_index()


def plot_epsilon(run_id: str, tracking_uri: str | None = None):
    """Epsilon (and training loss) versus step for one run, read back from MLflow (the same picture that every run
    logs as its ``training_curves.png`` artifact)."""
    from workbench.plots import training_curves

    df = epsilon_curve(run_id, tracking_uri)
    df = df[df["loss"].notna()]
    delta = _client(tracking_uri).get_run(run_id).data.metrics.get("delta")
    fig = training_curves(SimpleNamespace(steps=df["step"].tolist(), loss=df["loss"].tolist(),
                                          epsilon=df["epsilon"].tolist(), delta=delta))
    ax = fig.axes[0]
    ax.set_title(f"run {run_id[:8]}: {ax.get_title()}")
    return fig


# ------------------------------------------------------------------------------------------------------------- CLI

def make_frontier(out: str | Path, overrides: Sequence[str] = (), workdir: str | Path | None = None,
                  metric: str = "eval_accuracy"):
    """Run :data:`DEFAULT_SWEEP` into a fresh MLflow store (in `workdir`, else a temporary folder) and draw its
    frontier to `out` with :func:`plot_frontier`. Returns the sweep's runs table."""
    from mlflow import MlflowClient

    with (nullcontext(workdir) if workdir else tempfile.TemporaryDirectory(prefix="workbench-frontier-")) as wd:
        wd = Path(wd).resolve()
        wd.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{wd / 'mlflow.db'}"
        client = MlflowClient(uri)
        if client.get_experiment_by_name("frontier") is None:  # artifacts beside the store, not in the cwd
            client.create_experiment("frontier", artifact_location=(wd / "mlartifacts").as_uri())
        parent = sweep(DEFAULT_SWEEP, [f"tracking.uri={uri}", "tracking.experiment_name=frontier", "disable_tqdm=true",
                                       *overrides], sweep_dir=wd / "multirun" / time.strftime("%Y-%m-%d/%H-%M-%S"))
        runs = sweep_frame(parent, uri)
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        plot_frontier(runs, metric).savefig(out)
        if workdir:
            from workbench.tracking import ui_command

            print(f"runs kept: {ui_command(uri)}")
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.explore", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fr = sub.add_parser("frontier", help="run the default sweep (epsilon 1, 3, 8 and a non-private baseline) "
                                         "and draw eval metric vs epsilon")
    fr.add_argument("--out", default="docs/frontier.png", help="PNG to write (default: docs/frontier.png)")
    fr.add_argument("--workdir", default=None, help="keep the MLflow store and run folders here (default: a temp dir)")
    fr.add_argument("--metric", default="eval_accuracy")
    fr.add_argument("overrides", nargs="*", help="Hydra overrides for every point, e.g. num_train_epochs=10")
    args = parser.parse_args(argv)
    runs = make_frontier(args.out, args.overrides, args.workdir, args.metric)
    columns = [c for c in ("tags.overrides", "epsilon", "noise_multiplier", "steps", args.metric) if c in runs]
    print(runs[columns].to_string(index=False))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
