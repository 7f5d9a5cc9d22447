"""The store in a worker process (workbench/tracking/worker.py)."""

import pytest
from mlflow import MlflowClient


def test_tracking_worker_answers_as_the_store_does_and_is_replaced_when_it_dies(tmp_path):
    """The CLI's tracker talks to MLflow through a worker process (workbench.tracking.worker.WorkerStore): same calls,
    same refusals (a 404 stays a refusal the outbox will not retry), and a worker that died is replaced at the next
    call."""
    from workbench.tracking.outbox import StoreError, permanent
    from workbench.tracking.worker import WorkerStore

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = WorkerStore(uri)
    try:
        run_id = store.create_run(store.experiment_id("worker"), "r", {"k": "v"})
        store.send(run_id, ("metrics", [[{"loss": 0.5}, 3, 0]]))
        with pytest.raises(StoreError) as refused:
            store.status("no-such-run")
        assert refused.value.http_status == 404 and permanent(refused.value)
        store._proc.kill()
        store._proc.wait()
        store.send(run_id, ("status", "FINISHED"))
        assert store.status(run_id) == "FINISHED"
    finally:
        store.close()
    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.data.metrics["loss"] == 0.5 and run.data.tags["k"] == "v" and run.data.tags["status"] == "finished"
