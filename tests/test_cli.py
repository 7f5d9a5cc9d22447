"""`python -m workbench` as a user runs it: a real subprocess, a real SQLite MLflow store, read back with MlflowClient."""

import dp_accounting
import pytest
from mlflow import MlflowClient

from tests.conftest import run_cli
from workbench.privacy import DEFAULT_PLD_DISCRETIZATION
from workbench.privacy.accounting.accountant import LINE_SLACK


def test_default_job_end_to_end(tmp_path):
    proc = run_cli("callbacks=[{_target_: tests.plugins.ModulesAtExit}]", cwd=tmp_path)  # an inert probe
    assert proc.returncode == 0, proc.stderr[-3000:]
    # MLflow and the closing figure live in the tracking worker: the training process never imports them.
    assert (tmp_path / "modules-at-exit.txt").read_text() == ""
    summary = [line for line in proc.stdout.splitlines() if line.startswith("done:")]
    assert len(summary) == 1 and "epsilon=" in summary[0] and "mlflow ui --backend-store-uri" in summary[0]

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("workbench")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.info.run_id in summary[0]
    # The link opens the run in MLflow's training view (not the GenAI view a bare link opens).
    assert summary[0].endswith(f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}, then open "
                               f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}"
                               "?workflowType=machine_learning")
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
    line_steps = [h.step for h in client.get_metric_history(run.info.run_id, "learning_rate")]
    assert line_steps == sorted(set(line_steps)) and len(line_steps) == 17  # every 10 steps and the last (169)
    assert [h.step for h in history] == line_steps  # every log line carries epsilon
    for h in (history[0], history[8]):  # each its own step's epsilon by an independent computation, or at most
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=DEFAULT_PLD_DISCRETIZATION)
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(  # LINE_SLACK above it
            m["sample_rate"], dp_accounting.GaussianDpEvent(m["noise_multiplier"])), h.step))
        fresh = acc.get_epsilon(m["delta"])
        assert fresh * (1 - 1e-6) <= h.value <= fresh * (1 + LINE_SLACK)
    assert len(client.get_metric_history(run.info.run_id, "learning_rate")) == 17
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "checkpoints", "training_curves.png"} <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")] == [f"checkpoints/checkpoint-{int(m['steps'])}.pt"]


# Through the real CLI: exit code, one line on stderr, no traceback, no run left behind.
@pytest.mark.parametrize("args, message", [
    (["no_such_key=1"], "no_such_key"),
    (["model=no_such_model"], "no_such_model"),
    (["backend=nccl"], "ddp_backend=nccl"),
    (["split_batches=true"], "conflicts with Poisson sampling"),
    (["privacy.target_epsilon=1e-6"], "unreachable"),
    (["output_dir=/proc/forbidden"], "not writable"),
])
def test_bad_input_fails_fast_with_one_line_and_no_run(tmp_path, args, message):
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]  # the README's promise for bad input
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    if (tmp_path / "mlflow.db").exists():  # no run was started, so none is left RUNNING
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
        assert all(not client.search_runs([e.experiment_id]) for e in client.search_experiments())


# The same refusals in-process (the CLI prints exactly this message): the rest of the list.
@pytest.mark.parametrize("args, message", [
    (["backend=mpi"], "ddp_backend=mpi needs a torch built with MPI"),
    (["backend=xccl"], "ddp_backend=xccl needs Intel XPU"),
    (["backend=hccl"], "'torch_npu' is not installed"),
    (["backend=cncl"], "'torch_mlu' is not installed"),
    (["backend=mccl"], "'torch_musa' is not installed"),
    (["ddp_backend=smoke"], "ddp_backend='smoke' is unknown"),
    (["even_batches=false"], "even_batches is refused: it conflicts with Poisson sampling"),
    (["dispatch_batches=true"], "dispatch_batches is refused"),
    (["use_seedable_sampler=true"], "use_seedable_sampler is refused"),
    (["privacy.max_grad_norm=0"], "privacy.max_grad_norm must be > 0"),
    (["privacy.target_epsilon=-1"], "privacy.target_epsilon must be > 0"),
    (["privacy.target_delta=1.5"], "target_delta must be in (0, 1)"),
    (["privacy.noise_multiplier=0"], "gives no privacy"),
    (["privacy.accountant=moments"], "privacy.accountant='moments' is unknown"),
    (["per_device_train_batch_size=5000"], "larger than the training set"),
    (["data=synthetic", "data.train.size=0"], "the training dataset is empty"),
    (["model._target_=builtins.dict"], "not a torch.nn.Module"),
    (["model._target_=torch.nn.Linear"], "could not build model"),
    (["model._target_=tests.plugins.batchnorm_mlp", "privacy.fix_model=false"], "privacy.fix_model=true replaces it"),
    (["bf16=true", "fp16=true"], "choose one precision"),
    (["model._target_=tests.plugins.functional_weight_mlp", "privacy.grad_sample_mode=bk"],
     "gradient of 'fc.weight' is not its own"),  # auto trains it: per-example gradients of the whole model (vmap)
    (["compute_metrics=os.path.nosuch"], "not an importable function"),
    (["lr_scheduler_type=exotic"], "lr_scheduler_type='exotic' is unknown"),
])
def test_bad_input_is_refused_before_a_run_exists(make_cfg, mlflow_uri, args, message):
    from workbench.errors import WorkbenchError
    from workbench.launch import launch

    with pytest.raises(WorkbenchError) as err:
        launch(make_cfg(*args))
    assert message in str(err.value) and "\n" not in str(err.value)
    client = MlflowClient(tracking_uri=mlflow_uri)
    assert all(not client.search_runs([e.experiment_id]) for e in client.search_experiments())


def test_large_delta_warns(make_cfg):
    from workbench import train

    with pytest.warns(UserWarning, match="1/N"):
        train(make_cfg("experiment=quick", "privacy.target_delta=0.01"))
