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

from workbench.config import check_shared_streams
from workbench.plots import frontier as plot_frontier
from workbench.run_tables import epsilon_curve, mlflow_client, runs_frame, sweep_frame, sweep_summary

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
    from workbench.api import compose
    from workbench.run import train

    cfg = cfg_or_overrides if isinstance(cfg_or_overrides, DictConfig) else compose(list(cfg_or_overrides))
    return {**summary(train(cfg)), "world_size": int(os.environ.get("WORLD_SIZE", "1"))}


def train_local(cfg_or_overrides: DictConfig | Sequence[str] = (), nprocs: int = 2, timeout: float = 600) -> dict[str, Any]:
    """Train one config on `nprocs` local processes (one job, one process group, gloo on CPU) and return rank 0's
    :func:`summary`: metrics, epsilon, delta, steps, run_id... `per_device_train_batch_size` is per process."""
    from workbench.api import launch_distributed

    return launch_distributed(_train_on_rank, nprocs, cfg_or_overrides, timeout=timeout)[0]


def sweep(points: Sequence[Sequence[str]] = DEFAULT_SWEEP, overrides: Sequence[str] = (),
          sweep_dir: str | Path | None = None) -> str | None:
    """Train each point (a list of overrides, after the common `overrides`) in this process, one after the other, as
    child runs of one MLflow parent run, like ``python -m workbench -m ...`` does: the parent is made first and
    summarised at the end (table, frontier, best point, ``sweep_epsilon_all``; see workbench/sweep/). With
    ``sweep.tuning=random_stopping`` in `overrides`, each point is trained as many times as the random draw says.
    Run folders go under `sweep_dir` (default ``multirun/<date>/<time>``). Returns the parent run id (None with
    tracking off)."""
    from workbench import sweep as sweeps
    from workbench.api import compose
    from workbench.run import train

    check_shared_streams([compose([*overrides, *point]) for point in points])  # before the parent run is made
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
                train(cfg, on_end=sweeps.job_ended)
    finally:
        sweeps.finish(root)
    return state["parent_run_id"]


# ------------------------------------------------------------------------------------------------------ reading runs
# runs_frame, sweep_frame, sweep_summary and epsilon_curve live in workbench/run_tables.py (the sweep driver reads them too)

def plot_epsilon(run_id: str, tracking_uri: str | None = None):
    """Epsilon (and the training loss, where the run published it) versus step for one run, read back from MLflow (the same picture that every run
    logs as its ``training_curves.png`` artifact)."""
    from workbench.plots import training_curves

    df = epsilon_curve(run_id, tracking_uri)
    df = df[df["loss"].notna() | df["epsilon"].notna()]
    delta = mlflow_client(tracking_uri).get_run(run_id).data.metrics.get("delta")
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
            from workbench.tracking.uris import ui_command

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
