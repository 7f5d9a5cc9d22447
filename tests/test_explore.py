"""workbench.explore against a real SQLite MLflow store filled by real (seconds-long) training runs."""

import re
from pathlib import Path
from types import SimpleNamespace

import matplotlib.figure
import numpy as np
import pandas as pd
import pytest

from tests.conftest import REPO, run_cli
from workbench import compose, explore, train

QUICK = ["experiment=quick", "disable_tqdm=true"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A 3-point sweep (two private points, one non-private), a standalone run in the same experiment and one run in
    another experiment."""
    tmp = tmp_path_factory.mktemp("explore")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    common = [*QUICK, f"tracking.uri={uri}", "tracking.experiment_name=explore"]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)  # MLflow's default artifact root is ./mlruns
        parent = explore.sweep([["privacy.target_epsilon=2"], ["privacy.target_epsilon=4"], list(explore.BASELINE)],
                               common, sweep_dir=tmp / "multirun")
        single = train(compose([*common, "privacy.target_epsilon=3", f"output_dir={tmp / 'single'}"]))
        other = train(compose([*QUICK, f"tracking.uri={uri}", "tracking.experiment_name=other",
                               f"output_dir={tmp / 'other'}"]))
    return SimpleNamespace(uri=uri, parent=parent, single=single, other=other, tmp=tmp)


def test_runs_frame_one_row_per_run(store):
    df = explore.runs_frame("explore", tracking_uri=store.uri)
    assert len(df) == 4 and df.run_id.is_unique and (df.status == "FINISHED").all() and (df.role == "run").all()
    assert df.start_time.is_monotonic_increasing
    for column in ("run_id", "run_name", "start_time", "parent_run_id", "epsilon", "delta", "noise_multiplier",
                   "sample_rate", "steps", "eval_accuracy", "eval_loss", "params.learning_rate",
                   "params.privacy.target_epsilon", "params.privacy.enabled", "tags.world_size", "tags.backend"):
        assert column in df, column
    assert (df.steps == 20).all() and (df["tags.world_size"] == "1").all()
    assert df["params.learning_rate"].dtype.kind == "f"  # numbers, not MLflow's strings
    single = df.set_index("run_id").loc[store.single.run_id]
    assert single.epsilon == pytest.approx(store.single.epsilon) and pd.isna(single.parent_run_id)
    assert single.eval_accuracy == pytest.approx(store.single.metrics["eval_accuracy"])

    with_parent = explore.runs_frame("explore", tracking_uri=store.uri, include_sweeps=True)
    assert list(with_parent.role).count("sweep") == 1
    assert with_parent.set_index("role").loc["sweep", "run_id"] == store.parent
    everything = explore.runs_frame(tracking_uri=store.uri)
    assert store.other.run_id in set(everything.run_id) and len(everything) == 5
    with pytest.raises(ValueError, match="no MLflow experiment named 'missing'"):
        explore.runs_frame("missing", tracking_uri=store.uri)


def test_sweep_frame_groups_the_sweep(store):
    assert store.parent is not None
    df = explore.sweep_frame(store.parent, tracking_uri=store.uri)
    assert len(df) == 3 and (df.parent_run_id == store.parent).all()
    assert store.single.run_id not in set(df.run_id)
    assert list(df["tags.overrides"]) == ["privacy.target_epsilon=2", "privacy.target_epsilon=4", " ".join(explore.BASELINE)]
    private, baseline = df[df.epsilon.notna()], df[df.epsilon.isna()]
    assert (private.epsilon <= private["params.privacy.target_epsilon"]).all()
    assert len(baseline) == 1 and baseline["params.privacy.enabled"].iloc[0] == "False"
    assert baseline["params.learning_rate"].iloc[0] == 0.5
    assert pd.isna(baseline["params.privacy.target_epsilon"].iloc[0])  # null in the config: "None" in MLflow
    assert all(Path(p).parent == store.tmp / "multirun" for p in df["params.output_dir"])


def test_epsilon_curve_monotone(store):
    curve = explore.epsilon_curve(store.single.run_id, store.uri)
    assert list(curve.columns) == ["step", "epsilon", "loss"]
    assert list(curve.step) == [5, 10, 15, 20]  # experiment=quick logs every 5 of 20 steps
    logged = curve.epsilon  # every log line carries its own step's epsilon
    assert np.isfinite(logged).all() and logged.is_monotonic_increasing and (logged > 0).all()
    assert logged.iloc[-1] == pytest.approx(store.single.epsilon) and store.single.epsilon <= 3
    assert curve.loss.isna().all()  # a private run keeps its raw training loss out of MLflow (tracking.log_train_loss)
    assert curve.epsilon.tolist() == pytest.approx(store.single.history.epsilon, nan_ok=True)
    baseline = explore.sweep_frame(store.parent, store.uri).iloc[-1]
    baseline_curve = explore.epsilon_curve(baseline.run_id, store.uri)
    assert baseline_curve.epsilon.isna().all() and baseline_curve.loss.notna().all()  # non-private: its loss is logged


def test_plots_return_figures(store, tmp_path):
    fig = explore.plot_epsilon(store.single.run_id, store.uri)
    assert isinstance(fig, matplotlib.figure.Figure)
    ax = fig.axes[0]
    assert list(ax.lines[0].get_xdata()) == [5, 10, 15, 20]
    epsilon = np.asarray(ax.lines[0].get_ydata(), dtype=float)
    assert list(epsilon) == pytest.approx(list(explore.epsilon_curve(store.single.run_id, store.uri).epsilon))
    assert "delta = " in ax.get_ylabel()
    fig.savefig(tmp_path / "epsilon.png")

    runs = explore.sweep_frame(store.parent, store.uri)
    fig = explore.plot_frontier(runs, "eval_accuracy")
    assert isinstance(fig, matplotlib.figure.Figure)
    ax = fig.axes[0]
    frontier, baseline = ax.lines[0], ax.lines[1]
    assert list(frontier.get_xdata()) == sorted(runs.epsilon.dropna())
    assert set(baseline.get_ydata()) == {runs.eval_accuracy.iloc[-1]}  # a horizontal line
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("non-private baseline (lr=0.5)" in t for t in legend) and any("DP-SGD" in t for t in legend)
    fig.savefig(tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no column 'bogus'"):
        explore.plot_frontier(runs, "bogus")


@pytest.mark.slow
def test_frontier_command(tmp_path, monkeypatch):
    """`python -m workbench.explore frontier` (in-process here): the default sweep into its own store, then the PNG."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "docs" / "frontier.png"
    assert explore.main(["frontier", "--out", str(out), "--workdir", str(tmp_path / "work"), *QUICK]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = explore.runs_frame("frontier", tracking_uri=f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}")
    assert len(runs) == len(explore.DEFAULT_SWEEP) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "work"]  # nothing else in the working directory


def test_api_doc_example(tmp_path, monkeypatch):
    """The first ```python block of docs/API.md, executed as written."""
    text = (REPO / "docs" / "API.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    namespace: dict = {}
    exec(compile(block, "docs/API.md", "exec"), namespace)
    result = namespace["result"]
    assert result.epsilon <= 3 and result.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert (tmp_path / "mlflow.db").exists() and (tmp_path / "epsilon.png").exists() and (tmp_path / "frontier.png").exists()
    assert list(namespace["runs"].run_id) == [result.run_id]


@pytest.mark.slow
def test_train_local_two_processes(tmp_path, mlflow_uri, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the ranks inherit it (MLflow's default artifact root is ./mlruns)
    out = explore.train_local([*QUICK, f"tracking.uri={mlflow_uri}", "tracking.experiment_name=local",
                               f"output_dir={tmp_path / 'run'}", "privacy.target_epsilon=3"], nprocs=2)
    assert out["world_size"] == 2 and 0 < out["epsilon"] <= 3 and out["steps"] > 0
    assert out["tracking_uri"] == mlflow_uri and out["output_dir"] == str(tmp_path / "run")
    (row,) = explore.runs_frame("local", tracking_uri=mlflow_uri).to_dict("records")
    assert row["run_id"] == out["run_id"] and row["tags.world_size"] == "2" and row["status"] == "FINISHED"
    assert row["epsilon"] == pytest.approx(out["epsilon"])


@pytest.mark.slow
def test_cli_multirun_sweep_reads_back(tmp_path, mlflow_uri):
    """The command-line sweep (`python -m workbench -m ...`) groups its points the way sweep_frame reads them."""
    proc = run_cli("-m", *QUICK, "privacy.target_epsilon=2,4", f"tracking.uri={mlflow_uri}",
                   "tracking.experiment_name=cli", f"hydra.sweep.dir={tmp_path / 'multirun'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    everything = explore.runs_frame("cli", tracking_uri=mlflow_uri, include_sweeps=True)
    (parent,) = everything[everything.role == "sweep"].run_id
    df = explore.sweep_frame(parent, mlflow_uri)
    assert sorted(df["params.privacy.target_epsilon"]) == [2.0, 4.0]
    assert (df.epsilon <= df["params.privacy.target_epsilon"]).all()
    assert all("privacy.target_epsilon=" in o for o in df["tags.overrides"])


def test_training_curves_draw_what_was_logged():
    """A private run: every logged epsilon as a marker, delta in the label, a legend; no line through missing values.
    A non-private run: the loss alone, no epsilon axis."""
    from workbench.plots import training_curves
    from workbench.trainer import History

    history = History(steps=[10, 20, 30], loss=[2.0, 1.0, 0.5], epsilon=[1.0, float("nan"), 3.0], delta=1e-5)
    fig = training_curves(history)
    ax, twin = fig.axes
    eps_line = ax.lines[0]
    assert list(eps_line.get_xdata()) == [10, 20, 30] and eps_line.get_marker() == "."
    assert np.isnan(eps_line.get_ydata()[1])  # a gap where nothing was logged, not an interpolated point
    assert "delta = 1.0e-05" in ax.get_ylabel()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["epsilon (delta = 1.0e-05)", "training loss"]
    assert list(twin.lines[0].get_ydata()) == [2.0, 1.0, 0.5]

    fig = training_curves(History(steps=[10, 20], loss=[2.0, 1.0]))
    assert len(fig.axes) == 1
    (ax,) = fig.axes
    assert ax.get_ylabel() == "training loss" and len(ax.lines) == 1 and "non-private" in ax.get_title()
    assert "epsilon" not in " ".join(t.get_text() for t in ax.get_legend().get_texts())
