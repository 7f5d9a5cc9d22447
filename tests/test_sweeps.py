"""Hydra multirun sweeps in MLflow: one parent run per sweep, one child per point, even when points start at once."""

import multiprocessing as mp

from mlflow import MlflowClient

from tests.conftest import run_cli


def test_multirun_is_one_parent_with_a_child_per_point(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("-m", "experiment=quick", "privacy.target_epsilon=1,3", "disable_tqdm=true", cwd=tmp_path,
                   env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stderr[-2000:]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    parents = [r for r in runs if r.data.tags.get("workbench.role") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    assert parents[0].info.status == "FINISHED"  # a grouping run, never left RUNNING
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    by_target = {c.data.params["privacy.target_epsilon"]: c for c in children}
    assert set(by_target) == {"1.0", "3.0"}
    for target, child in by_target.items():
        assert f"privacy.target_epsilon={target[:-2]}" in child.data.tags["overrides"]
        assert child.data.metrics["epsilon"] <= float(target)
        assert child.info.status == "FINISHED"
    # The privacy-utility table of a sweep is one query.
    table = client.search_runs([parents[0].info.experiment_id],
                               f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    assert len(table) == 2


def _start_child(uri, sweep_dir, barrier):
    from workbench import compose
    from workbench.tracking import MlflowTracker

    cfg = compose([f"tracking.uri={uri}"])
    tracker = MlflowTracker(cfg)
    barrier.wait()
    tracker.start({"point": "x"}, sweep_dir=sweep_dir)
    tracker.finish()


def test_points_starting_at_once_share_one_parent(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from workbench import compose
    from workbench.tracking import MlflowTracker

    MlflowTracker(compose([f"tracking.uri={uri}"]))._experiment_id()  # the store exists, as after any first run
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_start_child, args=(uri, str(tmp_path / "sweep"), barrier)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    parents = [r for r in runs if r.data.tags.get("workbench.role") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 3
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
