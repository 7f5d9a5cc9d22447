"""Multirun sweeps in MLflow: one parent made by the driver, a child per point even when points start at once on a fresh
store, the parent's summary (table, frontier, best point, counts) and the sweep's privacy cost."""

import csv
import math
import multiprocessing as mp
import warnings
from types import SimpleNamespace

import dp_accounting
import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf

from tests.conftest import run_cli
from workbench import compose, config, explore, job, overrides, run, sweep
from workbench.errors import WorkbenchError
from workbench.privacy.accounting import tuning
from workbench.privacy import Accountant


def _sweep_runs(uri, experiment="workbench"):
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if r.data.tags.get("workbench.role") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


def _independent_epsilon_all(children, delta):
    """dp_accounting's own PLD accountant, composing each child's Poisson-subsampled Gaussian steps."""
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=2e-4)
    for c in children:
        m = c.data.metrics
        step = dp_accounting.PoissonSampledDpEvent(m["sample_rate"], dp_accounting.GaussianDpEvent(m["noise_multiplier"]))
        acc.compose(dp_accounting.SelfComposedDpEvent(step, int(m["steps"])))
    return acc.get_epsilon(delta)


def test_multirun_parent_summarises_the_sweep_and_its_cost(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # a fresh store: the driver creates it before any point starts
    proc = run_cli("-m", "experiment=quick", "privacy.target_epsilon=1,3,8", "disable_tqdm=true", cwd=tmp_path,
                   env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stderr[-2000:]
    client, parents, children = _sweep_runs(uri)
    assert len(parents) == 1 and len(children) == 3
    parent = parents[0]
    assert parent.info.status == "FINISHED"  # a grouping run, never left RUNNING
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    by_target = {c.data.params["privacy.target_epsilon"]: c for c in children}
    assert set(by_target) == {"1.0", "3.0", "8.0"}
    for target, child in by_target.items():
        assert f"privacy.target_epsilon={target[:-2]}" in child.data.tags["overrides"]
        assert child.data.metrics["epsilon"] <= float(target) and child.info.status == "FINISHED"

    m = parent.data.metrics
    assert (m["points"], m["points_finished"], m["points_failed"]) == (3, 3, 0)
    delta = children[0].data.metrics["delta"]
    assert m["sweep_delta"] == delta
    assert m["sweep_epsilon_all"] == pytest.approx(_independent_epsilon_all(children, delta), rel=0.01)
    assert m["sweep_epsilon_all"] > max(c.data.metrics["epsilon"] for c in children)
    best = max(children, key=lambda c: c.data.metrics["eval_accuracy"])
    assert m["best_eval_accuracy"] == best.data.metrics["eval_accuracy"]
    assert parent.data.tags["best_eval_accuracy_run_id"] in {c.info.run_id for c in children
                                                             if c.data.metrics["eval_accuracy"] == m["best_eval_accuracy"]}

    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"sweep_table.csv", "frontier.png"}
    with open(client.download_artifacts(parent.info.run_id, "sweep_table.csv", str(tmp_path))) as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["run_id"] for r in rows) == sorted(c.info.run_id for c in children)
    assert list(rows[0])[:4] == ["overrides", "status", "epsilon", "delta"] and "eval_accuracy" in rows[0]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("sweep done: 3 points (3 FINISHED, 0 FAILED)") and parent.info.run_id in last
    assert "sweep_epsilon_all=" in last and "best eval_accuracy=" in last
    # what the parent shows, and under which epsilon: every point published, so everything is the composition's
    assert parent.data.tags["privacy_adjacency"] == "add-or-remove one example"  # its points' own (one process)
    assert "sweep_epsilon_best_covers" not in parent.data.tags
    assert "sweep_table.csv" in parent.data.tags["sweep_epsilon_all_covers"]
    assert f"covered by sweep_epsilon_all={m['sweep_epsilon_all']:.3f}" in parent.data.tags["mlflow.note.content"]


@pytest.mark.slow
def test_failed_point_is_counted_and_the_sweep_still_summarised(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("-m", "experiment=quick", "compute_metrics=workbench.metrics.accuracy,tests.plugins.broken_metrics",
                   "disable_tqdm=true", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode != 0  # Hydra fails the sweep at the failed point
    _, parents, children = _sweep_runs(uri)
    assert len(parents) == 1 and sorted(c.info.status for c in children) == ["FAILED", "FINISHED"]
    m = parents[0].data.metrics
    assert (m["points"], m["points_finished"], m["points_failed"]) == (2, 1, 1)
    # The failed point trained before it failed: it counts, with its planned steps (an upper bound).
    finished = next(c for c in children if c.info.status == "FINISHED")
    planned = dp_accounting.pld.PLDAccountant(value_discretization_interval=2e-4)
    step = dp_accounting.PoissonSampledDpEvent(finished.data.metrics["sample_rate"],
                                               dp_accounting.GaussianDpEvent(finished.data.metrics["noise_multiplier"]))
    planned.compose(dp_accounting.SelfComposedDpEvent(step, 20), 2)
    assert m["sweep_epsilon_all"] == pytest.approx(planned.get_epsilon(m["sweep_delta"]), rel=0.01)


@pytest.mark.slow
def test_local_launcher_sweep_on_a_fresh_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("-m", "launcher=local", "launcher.nprocs=1", "experiment=quick", "seed=0,1", "disable_tqdm=true",
                   cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _, parents, children = _sweep_runs(uri)
    assert len(parents) == 1 and sorted(c.info.status for c in children) == ["FINISHED", "FINISHED"]
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert parents[0].data.metrics["points_finished"] == 2 and "sweep_epsilon_all" in parents[0].data.metrics


ROUNDS, POINTS = 5, 8


def _point(tmp, index, barrier):
    """One sweep point, tracking only, 5 times over: first use of a fresh store at once with every other point and the
    driver, then (once the driver has written the parent) a child run started at once with the others."""
    from workbench.tracking import MlflowTracker

    for r in range(ROUNDS):
        cfg = compose([f"tracking.uri=sqlite:///{tmp / f'round{r}.db'}"])
        barrier.wait()  # every process opens the fresh store at once
        tracker = MlflowTracker(cfg)
        tracker._experiment_id()
        barrier.wait()  # the driver has made the parent
        tracker.start({"point": str(index)}, sweep_dir=str(tmp / f"sweep{r}"))
        tracker.log_metrics({"eval_accuracy": index / 10}, 1)
        tracker.finish()
        barrier.wait()


@pytest.mark.slow
def test_points_starting_at_once_on_a_fresh_store_share_one_parent(tmp_path):
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - imported once, here: forked points start at once

    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(POINTS + 1, timeout=300)
    procs = [ctx.Process(target=_point, args=(tmp_path, i, barrier)) for i in range(POINTS)]
    for p in procs:
        p.start()
    try:
        for r in range(ROUNDS):
            uri = f"sqlite:///{tmp_path / f'round{r}.db'}"
            barrier.wait()
            sweep.start(compose([f"tracking.uri={uri}"]), tmp_path / f"sweep{r}")  # the driver, racing the points
            barrier.wait()
            barrier.wait()
            _, parents, children = _sweep_runs(uri)
            assert len(parents) == 1, f"round {r}"
            assert len(children) == POINTS and all(c.info.status == "FINISHED" for c in children), f"round {r}"
            assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * POINTS


def test_last_point_summarises_when_the_driver_left_first(tmp_path, capsys):
    from workbench.tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = compose([f"tracking.uri={uri}"])
    state = sweep.start(cfg, tmp_path / "sweep")
    points = [MlflowTracker(cfg) for _ in range(2)]
    for i, t in enumerate(points):
        t.start({"overrides": f"seed={i}"}, sweep_dir=str(tmp_path / "sweep"))
        t.log_metrics({"eval_accuracy": 0.5 + i / 10}, 1)
    points[0].finish()
    assert sweep.finish(tmp_path / "sweep") is None  # launcher.wait=false: the driver ends while a point runs
    assert "still running" in capsys.readouterr().out
    assert sweep.point_ended(tmp_path / "sweep") is None  # a point ends, another still runs
    points[1].finish()
    summary = sweep.point_ended(tmp_path / "sweep")
    assert summary["points_finished"] == 2 and summary["best_eval_accuracy"] == 0.6
    parent = MlflowClient(uri).get_run(state["parent_run_id"])
    assert parent.data.metrics["points"] == 2 and sweep.PENDING_TAG not in parent.data.tags
    assert parent.data.tags["best_eval_accuracy_run_id"] == points[1].run_id
    assert sweep.point_ended(tmp_path / "sweep") is None  # summarised once


# --------------------------------------------------------------------------------------------- privacy of a sweep


def test_truncated_negative_binomial_draws_have_the_papers_mean():
    import random

    s = compose(["sweep.trials=truncated_negative_binomial", "sweep.tnb_eta=0.5", "sweep.tnb_gamma=0.3"]).sweep
    pmf_mean = sum(k * tuning._tnb_pmf(k, 0.5, 0.3) for k in range(1, 2000))
    assert sum(tuning._tnb_pmf(k, 0.5, 0.3) for k in range(1, 2000)) == pytest.approx(1.0)
    assert pmf_mean == pytest.approx(tuning.expected_trials(s.trials, eta=0.5, gamma=0.3))
    rng = random.Random(0)
    draws = [sweep.draw_trials(s, rng) for _ in range(4000)]
    assert min(draws) >= 1 and sum(draws) / len(draws) == pytest.approx(pmf_mean, rel=0.1)


def test_random_stopping_sweep_trains_the_drawn_trials_and_reports_the_bound(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = ["experiment=quick", "disable_tqdm=true", f"tracking.uri={uri}", "sweep.tuning=random_stopping",
              "sweep.trials=truncated_negative_binomial", "sweep.tnb_eta=1", "sweep.tnb_gamma=0.5", "sweep.seed=3"]
    points = [["learning_rate=0.3"], ["learning_rate=0.6"]]
    parent = explore.sweep(points, common, sweep_dir=tmp_path / "sweep")
    trials = sweep.read_state(tmp_path / "sweep")["trials"]
    assert sum(trials) >= 1
    _, parents, children = _sweep_runs(uri)
    assert [p.info.run_id for p in parents] == [parent] and len(children) == sum(trials)
    m = parents[0].data.metrics
    assert m["sweep_epsilon_best"] > max(c.data.metrics["epsilon"] for c in children)
    runs = [(Accountant("pld", c.data.metrics["sample_rate"], c.data.metrics["noise_multiplier"]), 20) for c in children]
    args = (m["sweep_delta"], "truncated_negative_binomial", 3.0, 1, 0.5)
    assert m["sweep_epsilon_best_rdp"] == pytest.approx(tuning.random_stopping_epsilon(runs, *args))
    assert m["sweep_epsilon_best_profile"] == pytest.approx(tuning.profile_epsilon(runs, *args))
    assert m["sweep_epsilon_best"] == min(m["sweep_epsilon_best_rdp"], m["sweep_epsilon_best_profile"])
    assert "sweep_notes" not in parents[0].data.tags  # learning rates: one mechanism, every point bounded
    # The best-of-K bound covers the best trial's result alone, K hidden: K (the counts), the table, the frontier and
    # the other trials are labelled as the composition's, in the tags and in the run's description.
    tags = parents[0].data.tags
    best_fields = {"best_eval_accuracy", "best_eval_accuracy_run_id", "best_eval_accuracy_overrides"}
    assert best_fields <= set(tags) | set(m) and all(f in tags["sweep_epsilon_best_covers"] for f in best_fields)
    for published in ("points", "points_finished", "points_failed", "sweep_table.csv", "frontier.png", "trial tags"):
        assert published not in tags["sweep_epsilon_best_covers"] and published in tags["sweep_epsilon_all_covers"]
    note = tags["mlflow.note.content"]
    assert f"under sweep_epsilon_best={m['sweep_epsilon_best']:.3f}" in note
    assert f"K, the counts, the table, the frontier and the other trials are covered by sweep_epsilon_all=" \
           f"{m['sweep_epsilon_all']:.3f} only" in note
    assert tags["privacy_adjacency"] == "add-or-remove one example"


def test_a_random_stopping_sweep_with_a_pinned_secret_is_refused_before_any_work(tmp_path, monkeypatch):
    """Its trials would repeat one stream (not the independent trials the bound assumes): one line, exit 2, no store,
    no folder; explore.sweep refuses before it makes anything too, also when only a point pins the secret."""
    proc = run_cli("-m", "experiment=quick", "sweep.tuning=random_stopping", "privacy.secure_seed=123456789",
                   "learning_rate=0.3,0.6", "disable_tqdm=true", cwd=tmp_path,
                   env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "sweep.tuning=random_stopping with a pinned privacy.secure_seed" in proc.stderr
    assert "123456789" not in proc.stderr and sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.chdir(tmp_path)
    common = ["experiment=quick", "disable_tqdm=true", f"tracking.uri=sqlite:///{tmp_path / 'nb.db'}",
              "sweep.tuning=random_stopping"]
    for points, extra in (([["learning_rate=0.3"]], ["privacy.secure_seed=5"]),
                          ([["learning_rate=0.3"], ["privacy.secure_seed=5"]], [])):
        with pytest.raises(WorkbenchError, match="pinned privacy.secure_seed"):
            explore.sweep(points, [*common, *extra], sweep_dir=tmp_path / "sweep")
        assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert compose([*common[:2], "privacy.secure_seed=5"]).sweep.tuning == "all"  # tuning=all keeps it (one stream each)


def test_sweep_points_sharing_a_pinned_secret_and_seed_are_refused_before_any_work(tmp_path, monkeypatch):
    """Two points with one pinned secret and one seed draw the same noise: releasing both lets it cancel (at C1 and
    C2, S1/C1 - S2/C2 is noise-free), which sweep_epsilon_all's composition does not cover. One line, exit 2, nothing
    made, from the CLI and explore.sweep; points whose seeds or secrets differ draw other streams and pass."""
    proc = run_cli("-m", "experiment=quick", "privacy.secure_seed=123456789", "learning_rate=0.3,0.6",
                   "disable_tqdm=true", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "sweep points 1 and 2 pin the same privacy.secure_seed and draw the same noise" in proc.stderr
    assert "123456789" not in proc.stderr and sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.chdir(tmp_path)
    common = ["experiment=quick", "disable_tqdm=true", f"tracking.uri=sqlite:///{tmp_path / 'nb.db'}"]
    with pytest.raises(WorkbenchError, match="pin the same privacy.secure_seed"):
        explore.sweep([["learning_rate=0.3"], ["learning_rate=0.6"]], [*common, "privacy.secure_seed=5"],
                      sweep_dir=tmp_path / "sweep")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(WorkbenchError, match="pin the same privacy.secure_seed"):  # other batches, the same noise
        config.check_shared_streams([compose([*common, "privacy.secure_seed=5", f"data_seed={s}"]) for s in (0, 1)])
    with pytest.raises(WorkbenchError, match="draw the same batches"):  # other noise, the same batches: sigma / sqrt 2
        config.check_shared_streams([compose([*common, "privacy.secure_seed=5", "data_seed=7", f"seed={s}"])
                                     for s in (1, 2)])
    for points in ([["seed=0", "data_seed=0"], ["seed=1", "data_seed=1"]], [["privacy.secure_seed=5"], ["privacy.secure_seed=6"]],
                   [["learning_rate=0.3"], ["learning_rate=0.6", "privacy.enabled=false"]]):
        config.check_shared_streams([compose([*common, "privacy.secure_seed=5", *point]) for point in points])
    config.check_shared_streams([compose([*common, f"learning_rate={lr}"]) for lr in (0.3, 0.6)])  # fresh secrets


def test_a_candidate_is_planned_with_the_values_the_user_typed():
    """Random stopping plans every point, drawn or not, from the config Hydra would give it (driver._job_config):
    data.train.size=2048 typed for a replaced _target_ (equal to no default of it) reaches the candidate's q."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from workbench.sweep import driver

    typed = ["experiment=quick", "data.train._target_=workbench.data.SyntheticImages", "data.train.size=2048"]
    config.register()  # the schema Hydra's compose reads (workbench.compose registers it too)
    with initialize_config_dir(config_dir=str(config.CONF_DIR), version_base="1.3"):
        cfg = driver._job_config(hydra_compose(config_name="config", return_hydra_config=True), typed)
    assert overrides.own_arguments(cfg, "data.train")["size"] == 2048
    assert job.planned_mechanism(cfg)["sample_rate"] == pytest.approx(cfg.per_device_train_batch_size / 2048)


def test_random_stopping_bounds_every_point_of_the_grid_drawn_or_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = ["experiment=quick", "disable_tqdm=true", f"tracking.uri={uri}", "sweep.tuning=random_stopping",
              "sweep.trials=poisson", "sweep.poisson_mean=1"]
    points = [["privacy.target_epsilon=1"], ["privacy.target_epsilon=8"]]
    s = OmegaConf.to_container(compose(common).sweep)
    seed = next(i for i in range(1000) if sweep.draw(SimpleNamespace(**{**s, "seed": i}), 2) == [1, 0])  # only eps 1
    parent = explore.sweep(points, [*common, f"sweep.seed={seed}"], sweep_dir=tmp_path / "sweep")
    _, _, children = _sweep_runs(uri)
    assert [c.data.params["privacy.target_epsilon"] for c in children] == ["1.0"]
    m = MlflowClient(uri).get_run(parent).data.metrics
    # The epsilon-8 point never trained, yet the bound is that of the grid's worst point, built from its config.
    eight = compose([*common, *points[1]])
    worst = job.planned_mechanism(eight)
    mechanism = [(Accountant("pld", worst["sample_rate"], worst["noise_multiplier"]), worst["planned_steps"])]
    args = (m["sweep_delta"], "poisson", 1.0)
    assert m["sweep_epsilon_best_rdp"] == pytest.approx(tuning.random_stopping_epsilon(mechanism, *args), rel=1e-9)
    assert m["sweep_epsilon_best_profile"] == pytest.approx(tuning.profile_epsilon(mechanism, *args), rel=1e-9)
    assert m["sweep_epsilon_best"] == min(m["sweep_epsilon_best_rdp"], m["sweep_epsilon_best_profile"])
    assert m["sweep_epsilon_best"] > 8.0  # more than the worst point's own epsilon, not the trained point's 1
    trained = [(Accountant("pld", children[0].data.metrics["sample_rate"],
                           children[0].data.metrics["noise_multiplier"]), 20)]
    assert m["sweep_epsilon_best"] > tuning.random_stopping_epsilon(trained, *args) + 3


def test_points_on_different_data_warn_that_the_bound_does_not_apply(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = ["experiment=quick", "disable_tqdm=true", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explore.sweep([["data.train.seed=0"], ["data.train.seed=5"], ["privacy=none"]], common,
                      sweep_dir=tmp_path / "sweep")
    messages = [str(w.message) for w in caught if str(w.message).startswith("sweep:")]
    assert any("trained on different data" in m and "neighbour" in m for m in messages)
    assert any("'privacy=none' is not private" in m for m in messages)


def test_a_non_private_candidate_makes_the_best_bound_infinite_with_a_note(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = ["experiment=quick", "disable_tqdm=true", f"tracking.uri={uri}", "sweep.tuning=random_stopping",
              "sweep.trials=poisson", "sweep.poisson_mean=1"]
    points = [["privacy.target_epsilon=3"], ["privacy.noise_multiplier=0"], ["privacy=none"]]
    s = OmegaConf.to_container(compose(common).sweep)
    seed = next(i for i in range(1000) if sweep.draw(SimpleNamespace(**{**s, "seed": i}), 3) == [1, 0, 0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parent = explore.sweep(points, [*common, f"sweep.seed={seed}"], sweep_dir=tmp_path / "sweep")
    run_ = MlflowClient(uri).get_run(parent)
    m = run_.data.metrics
    # MLflow stores an infinite metric as the largest float
    assert min(m["sweep_epsilon_best"], m["sweep_epsilon_best_profile"], m["sweep_epsilon_best_rdp"]) > 1e300
    assert math.isfinite(m["sweep_epsilon_all"])  # what trained (epsilon 3) is bounded
    notes = run_.data.tags["sweep_notes"]
    assert "no finite bound for publishing the best" in notes
    assert "'privacy.noise_multiplier=0' (privacy.noise_multiplier=0 gives no privacy" in notes
    assert "'privacy=none' (not private)" in notes
    assert any("no finite bound" in str(w.message) for w in caught)


def test_a_launched_job_reports_its_end_to_the_sweep_through_the_hook(make_cfg, tmp_path, monkeypatch):
    """A point's job calls the sweep back (so the last point of a sweep whose driver left summarises it) through the
    hook its launcher passes in: the job itself never imports the sweep layer. A failing hook never fails the run."""
    from workbench import launch
    from workbench.sweep import driver

    ended = []
    monkeypatch.setattr(driver, "point_ended", lambda sweep_dir: ended.append(str(sweep_dir)))
    cfg = make_cfg("experiment=quick", "privacy=none", "max_steps=1", f"tracking.sweep_dir={tmp_path / 'sweep'}")
    launch.launch(cfg)
    assert ended == [str(tmp_path / "sweep")]

    def broken(cfg):
        raise RuntimeError("the sweep's store is gone")

    assert run.train(make_cfg("experiment=quick", "privacy=none", "max_steps=1"), on_end=broken).steps == 1


@pytest.mark.slow
def test_a_sweep_over_adaptive_clipping_and_dp_adamw_composes_each_point_at_its_stated_sigma(tmp_path):
    """Issue 23's features inside a multirun: fixed versus adaptive C, each with the private Adam. An adaptive point
    spends what a fixed-C run at its stated sigma spends (the count's noise is paid by raising the gradient's), so the
    parent's cost of publishing both is dp-accounting's composition of the children's stated sigmas."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("-m", "experiment=quick", "privacy.clipping=fixed,adaptive", "optimizer=dp_adamw",
                   "learning_rate=0.001", "privacy.target_epsilon=3", "disable_tqdm=true", cwd=tmp_path,
                   env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stderr[-2000:]
    client, parents, children = _sweep_runs(uri)
    assert len(parents) == 1 and len(children) == 2 and parents[0].info.status == "FINISHED"
    by_mode = {c.data.params["privacy.clipping"]: c for c in children}
    assert set(by_mode) == {"fixed", "adaptive"}
    assert {c.data.params["optimizer._target_"] for c in children} == {"workbench.optim.DPAdamW"}
    fixed, adaptive = by_mode["fixed"].data.metrics, by_mode["adaptive"].data.metrics
    assert fixed["noise_multiplier"] == adaptive["noise_multiplier"] and fixed["epsilon"] == adaptive["epsilon"] <= 3
    assert adaptive["gradient_noise_multiplier"] > adaptive["noise_multiplier"] and "clip_norm" not in fixed
    c_line = client.get_metric_history(by_mode["adaptive"].info.run_id, "clip_norm")
    assert sorted(m.step for m in c_line) == [5, 10, 15, 20]  # C on every logged line
    m = parents[0].data.metrics
    assert m["sweep_epsilon_all"] == pytest.approx(_independent_epsilon_all(children, fixed["delta"]), rel=0.01)
