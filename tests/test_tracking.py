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
