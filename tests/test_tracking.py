"""A job's tracker against real stores (workbench/tracking/tracker.py): a run recorded through a real `mlflow server`
on 127.0.0.1, failure paths that must not leave RUNNING, and which ranks track; the package's old import paths."""

import pytest
from mlflow import MlflowClient

from tests.conftest import run_cli
from workbench.distributed import Dist, JobEnv


@pytest.mark.slow
def test_run_recorded_through_a_real_tracking_server(mlflow_server, tmp_path):
    url, artifact_root = mlflow_server
    proc = run_cli("experiment=quick", f"tracking.uri={url}", "tracking.experiment_name=server", "disable_tqdm=true",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"open {url}" in proc.stdout
    client = MlflowClient(tracking_uri=url)
    runs = client.search_runs([client.get_experiment_by_name("server").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["steps"] == 20
    assert not (tmp_path / "mlflow.db").exists()  # nothing went to the local default store
    # Artifacts travelled over HTTP into the server's artifact destination.
    names = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"config.yaml", "checkpoints", "training_curves.png"} <= names
    assert list(artifact_root.rglob("checkpoint-20.pt"))


def test_failure_after_the_run_started_ends_failed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("experiment=quick", "compute_metrics=tests.plugins.broken_metrics", cwd=tmp_path,
                   env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode != 0 and "metric exploded" in proc.stderr
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    assert not list((tmp_path / "outputs").rglob("*.tmp*"))


@pytest.mark.parametrize("local_rank, rank, on_each_node, expect_log, expect_save", [
    (0, 0, True, True, True), (0, 2, True, True, False), (1, 1, True, False, False), (0, 2, False, False, False),
])
def test_rank_gating(local_rank, rank, on_each_node, expect_log, expect_save):
    env = JobEnv(rank=rank, world_size=4, local_rank=local_rank, local_world_size=2)
    d = Dist(env, "gloo", None, owns_group=False, log_on_each_node=on_each_node, save_on_each_node=False)
    assert d.should_log is expect_log
    assert d.should_save is expect_save  # save_on_each_node=False: world rank 0 only
    saving = Dist(env, "gloo", None, owns_group=False, save_on_each_node=True)
    assert saving.should_save is (local_rank == 0)
    assert d.is_main is (rank == 0)


def test_the_old_import_paths_name_the_same_objects():
    """The modules workbench.tracking and workbench.outbox became the package workbench/tracking/: every name code
    imported from workbench.tracking is still there, the very object of the module that now holds it."""
    import workbench.tracking as tracking
    from workbench.tracking import outbox, redaction, runs, store, tracker, upload, uris, worker

    homes = {uris: ["tracking_uri", "ui_command", "ui_link", "uri_problem", "reachable", "URI_SCHEMES", "FAST_FAIL_ENV",
                    "CHECK_TIMEOUT"],
             redaction: ["flatten", "scrub", "redacted"],
             runs: ["PARENT_TAG", "SWEEP_TAG", "SWEEP_FILE", "sweep_parent", "git_sha"],
             outbox: ["Outbox", "StoreError", "permanent", "read_spool", "write_spool", "spool_dir", "stage", "unstage",
                      "tidy", "only_new", "unsent_lines"],
             store: ["Store", "STORE_CALLS", "_retry", "init_store", "logged_until", "send"],
             worker: ["WorkerStore", "prestart", "serve", "RANK_ENV", "RANK_ENV_PREFIXES"],
             tracker: ["NullTracker", "MlflowTracker", "make_tracker", "end_if_abandoned", "FLUSH_WAIT"],
             upload: ["sync"]}
    for module, names in homes.items():
        for name in names:
            assert getattr(tracking, name) is getattr(module, name), f"workbench.tracking.{name}"
    assert callable(tracking.main)


def test_the_end_waits_for_a_slow_store_that_answers_and_gives_up_on_a_silent_one():
    """finish() drains with ``stalled``: its timeout counts from the last operation sent. A store that answers every
    call slowly (a loaded machine) gets everything, however long the queue takes in all; a silent one is given up on
    after the timeout (its calls are then spooled), and a plain drain stays a bound on the total wait."""
    import time

    from workbench.tracking.outbox import Outbox

    def slow(op):
        time.sleep(0.15)

    for stalled, expect in ((True, True), (False, False)):
        box = Outbox(slow)
        for i in range(6):  # 0.9 s of sends in all, 0.15 s each: more than the 0.5 s timeout, less per call
            box.put(("tags", {"i": i}))
        assert box.drain(0.5, stalled=stalled) is expect
        box.close()

    def silent(op):
        raise OSError("no answer")

    box = Outbox(silent)
    box.put(("tags", {}))
    t = time.monotonic()
    assert box.drain(0.5, stalled=True) is False
    assert 0.5 <= time.monotonic() - t < 3
    assert box.close() == [("tags", {})]


def _line(step: int) -> dict[str, float]:
    """What a private run's loop logs at a step: no loss (it is not published), epsilon beside the rest."""
    return {"epoch": step / 10, "learning_rate": 0.5 - step / 100, "samples_per_second": 100.0 + step,
            "epsilon": step / 7}


def test_a_resumed_private_run_logs_each_metric_at_each_step_once_spool_replay_included(tmp_path):
    """Interrupted after step 7 with a checkpoint at 5, its lines 6..9 spooled as well (the server took 1..7 before
    the spool was written): the resumed tracker replays the spool, then gets the recomputed steps 6..12 and the final
    summary at 12 (epsilon again there). Every (metric, step) is in MLflow once, with the first job's value."""
    from tests.conftest import metric_history
    from workbench import compose
    from workbench.tracking import MlflowTracker, write_spool

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = compose([f"tracking.uri={uri}", f"output_dir={tmp_path / 'run'}"])
    first = MlflowTracker(cfg)
    first.start({})
    first.log_many([(_line(s), s) for s in range(1, 8)])
    first.log_metrics({"eval_loss": 0.3, "eval_accuracy": 0.9}, 5)
    first.finish("KILLED")
    write_spool(tmp_path / "run", uri, first.run_id, [("metrics", [[_line(s), s, 0] for s in range(6, 10)])])

    resumed = MlflowTracker(cfg)
    resumed.start({}, run_id=first.run_id)
    recomputed = {s: {**_line(s), "samples_per_second": -1.0} for s in range(6, 13)}  # a timing differs on a rerun
    resumed.log_many([(line, s) for s, line in recomputed.items()])
    resumed.log_metrics({"eval_loss": 0.3, "eval_accuracy": 0.9}, 10)
    resumed.log_metrics({"eval_loss": 0.2, "steps": 12, "epsilon": _line(12)["epsilon"]}, 12)
    resumed.finish()

    got = metric_history(uri, first.run_id)
    want = {(k, s, v) for s in range(1, 10) for k, v in _line(s).items()}
    want |= {(k, s, v) for s in range(10, 13) for k, v in recomputed[s].items()}
    want |= {("eval_loss", 5, 0.3), ("eval_accuracy", 5, 0.9), ("eval_loss", 10, 0.3), ("eval_accuracy", 10, 0.9),
             ("eval_loss", 12, 0.2), ("steps", 12, 12.0)}
    assert sorted(got) == sorted(want)  # as a list: a pair logged twice would be there twice
    assert not list((tmp_path / "run").rglob("ops-*.jsonl"))  # the replayed spool is gone


def test_sync_sends_each_metric_at_each_step_once_from_overlapping_spool_files(tmp_path):
    """A job killed between writing its new spool file and removing the one it replaces leaves two that overlap; the
    server already holds the first steps. sync uploads each (metric, step) once, and refuses a store that is not
    there without creating it."""
    from tests.conftest import metric_history
    from workbench.errors import WorkbenchError
    from workbench.tracking import sync, write_spool

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    from mlflow.entities import Metric

    client.log_batch(run_id, metrics=[Metric(k, v, 0, s) for s in range(1, 6) for k, v in _line(s).items()])
    # each file's own times (MLflow's store keeps one of two rows identical in time too)
    write_spool(tmp_path, uri, run_id, [("metrics", [[_line(s), s, 1000 + s] for s in range(4, 9)])])
    write_spool(tmp_path, uri, run_id, [("metrics", [[_line(s), s, 2000 + s] for s in range(7, 11)])])
    sync(tmp_path)
    assert sorted(metric_history(uri, run_id)) == sorted((k, s, v) for s in range(1, 11) for k, v in _line(s).items())

    write_spool(tmp_path, uri, run_id, [("metrics", [[_line(11), 11, 0]])])
    missing = tmp_path / "elsewhere.db"
    with pytest.raises(WorkbenchError, match=f"MLflow run {run_id} is not in sqlite:///{missing}: there is no store"):
        sync(tmp_path, f"sqlite:///{missing}")
    assert not missing.exists()
