"""`python -m workbench` as a user runs it: a real subprocess, a real SQLite MLflow store, read back with MlflowClient."""

import dp_accounting
import pytest
from mlflow import MlflowClient

from tests.conftest import run_cli
from workbench.privacy import DEFAULT_PLD_DISCRETIZATION


def test_default_job_end_to_end(tmp_path):
    proc = run_cli(cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("done:")]
    assert len(summary) == 1 and "epsilon=" in summary[0] and "mlflow ui --backend-store-uri" in summary[0]

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("workbench")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.info.run_id in summary[0]
    m, params, tags = run.data.metrics, run.data.params, run.data.tags

    # The product's promise on the embedded default.
    assert m["eval_accuracy"] >= 0.93
    assert m["epsilon"] <= 8.0
    assert m["delta"] == pytest.approx(1e-5)
    # Reported epsilon equals an independent dp_accounting computation for the logged (q, sigma, steps).
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=DEFAULT_PLD_DISCRETIZATION)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(m["sample_rate"], dp_accounting.GaussianDpEvent(m["noise_multiplier"])),
        int(m["steps"])))
    assert m["epsilon"] == pytest.approx(acc.get_epsilon(m["delta"]), rel=1e-6)
    assert m["sample_rate"] == pytest.approx(256 / 1437)

    assert params["privacy.target_epsilon"] == "8.0" and params["per_device_train_batch_size"] == "256"
    assert tags["backend"] == "gloo" and tags["world_size"] == "1" and tags["ddp_shard"] == "per_rank"
    assert tags["hydra/data"] == "digits" and tags["hydra/model"] == "mlp"
    history = sorted(client.get_metric_history(run.info.run_id, "epsilon"), key=lambda h: h.step)
    assert [h.value for h in history] == sorted(h.value for h in history)  # epsilon only grows
    assert history[-1].step == m["steps"] and history[-1].value == m["epsilon"]
    loss_steps = [h.step for h in client.get_metric_history(run.info.run_id, "loss")]
    assert loss_steps == sorted(set(loss_steps)) and len(loss_steps) == 17  # every 10 steps and the last (169)
    assert {h.step for h in history} <= set(loss_steps)  # epsilon rides on log lines (all, unless it falls behind)
    assert len(client.get_metric_history(run.info.run_id, "learning_rate")) == 17
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "checkpoints", "training_curves.png"} <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")] == [f"checkpoints/checkpoint-{int(m['steps'])}.pt"]


@pytest.mark.parametrize("args, message", [
    (["no_such_key=1"], "no_such_key"),
    (["model=no_such_model"], "no_such_model"),
    (["backend=nccl"], "ddp_backend=nccl"),
    (["backend=mpi"], "ddp_backend=mpi"),
    (["backend=xccl"], "ddp_backend=xccl"),
    (["backend=hccl"], "torch_npu"),
    (["ddp_backend=smoke"], "ddp_backend='smoke' is unknown"),
    (["split_batches=true"], "conflicts with Poisson sampling"),
    (["even_batches=false"], "conflicts with Poisson sampling"),
    (["privacy.max_grad_norm=0"], "privacy.max_grad_norm must be > 0"),
    (["privacy.target_epsilon=-1"], "privacy.target_epsilon must be > 0"),
    (["privacy.target_delta=1.5"], "target_delta must be in (0, 1)"),
    (["privacy.target_epsilon=1e-6"], "unreachable"),
    (["per_device_train_batch_size=5000"], "larger than the training set"),
    (["output_dir=/proc/forbidden"], "not writable"),
    (["data.train.size=0", "data=synthetic"], "empty"),
    (["model._target_=builtins.dict"], "not a torch.nn.Module"),
    (["model._target_=torch.nn.Sequential"], "could not build model"),
])
def test_bad_input_fails_fast_with_one_line_and_no_run(tmp_path, args, message):
    proc = run_cli(*args, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    if (tmp_path / "mlflow.db").exists():  # no run was started, so none is left RUNNING
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
        assert all(not client.search_runs([e.experiment_id]) for e in client.search_experiments())
