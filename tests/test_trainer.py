"""The training loop (workbench/trainer.py) through whole jobs: the update it applies is the clipped sum over the
expected batch, and a step that turns non-finite or meets bad data ends the run in one line."""

import pytest
import torch

from tests.oracle import clipped_sum, rows


@pytest.mark.parametrize("private", [True, False])
def test_non_finite_update_stops_the_run_at_its_step_and_keeps_the_last_good_checkpoint(make_cfg, mlflow_uri, tmp_path,
                                                                                         private):
    """Non-private: NaN data from step 5 on turns the update non-finite. Private: an example's NaN only zeroes its own
    contribution (the next test), so what stops a private run is divergence: here the optimizer's, at step 5."""
    from mlflow import MlflowClient

    from workbench import train
    from workbench.errors import TrainingStopped

    cause = ["optimizer._target_=tests.plugins.DivergingSGD", "+optimizer.diverge_at=5"] if private else \
        ["data.train._target_=tests.plugins.PoisonedSynthetic", "+data.train.poison_from=5", "privacy=none"]
    cfg = make_cfg("experiment=quick", "save_steps=2", "logging_steps=1", *cause)
    with pytest.raises(TrainingStopped) as err:
        train(cfg)
    what = "the parameters" if private else "the noised update"
    assert str(err.value).startswith(f"training stopped at step 5: {what} became non-finite")
    assert "\n" not in str(err.value)
    client = MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "learning_rate")] == [1, 2, 3, 4]
    from workbench.checkpoint import list_checkpoints

    saved = [p.name for p in list_checkpoints(tmp_path / "run")]
    assert saved == ["checkpoint-2.pt", "checkpoint-4.pt"]  # written before the bad step; none after it
    state = torch.load(list_checkpoints(tmp_path / "run")[-1], weights_only=False)
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_nan_data_in_a_private_run_zeroes_those_examples_and_the_run_goes_on(make_cfg, mlflow_uri):
    """Every example is NaN from step 5 on: each contributes 0 (a function of itself alone, norm <= C), so the release
    is the noise alone, finite: no stop and no skipped step that would tell the data apart without noise."""
    from workbench import train

    result = train(make_cfg("experiment=quick", "data.train._target_=tests.plugins.PoisonedSynthetic",
                            "+data.train.poison_from=5", "tracking.enabled=false"))
    assert result.steps == 20
    assert all(bool(torch.isfinite(p).all()) for p in result.model.parameters())


def test_update_is_the_clipped_sum_over_the_expected_batch_not_the_realised_one(make_cfg, tmp_path):
    """Contract step 4 through the whole job: one SGD step moves the parameters by -lr * (clipped sum + noise) / B.
    Runs with the same secret draw the same batch indices and the same noise whatever the data (N is fixed), so the
    noise cancels in the difference of two data sets' updates; two learning rates on one data set give the start."""
    from hydra.utils import instantiate

    from tests.plugins import RecordingSynthetic
    from workbench import train

    batch, clip = 64, 0.1
    common = ["experiment=quick", "max_steps=1", "optimizer.momentum=0", "weight_decay=0", "lr_scheduler_type=constant",
              "privacy.secure_seed=11", "privacy.noise_multiplier=1", "privacy.target_epsilon=null",
              f"per_device_train_batch_size={batch}", f"privacy.max_grad_norm={clip}",
              "data.train._target_=tests.plugins.RecordingSynthetic", "tracking.enabled=false"]
    after, fetched = {}, {}
    for lr, data_seed in ((0.5, 0), (1.0, 0), (0.5, 3)):
        RecordingSynthetic.fetched = []
        after[lr, data_seed] = [p.detach() for p in train(make_cfg(
            *common, f"learning_rate={lr}", f"data.train.seed={data_seed}",
            f"output_dir={tmp_path / f'{lr}-{data_seed}'}")).model.parameters()]
        fetched[data_seed] = RecordingSynthetic.fetched[-1]  # the last fetch is step 0's batch
    start = [2 * a - b for a, b in zip(after[0.5, 0], after[1.0, 0])]  # p0 - lr g at lr = 0.5 and 1
    assert fetched[0] == fetched[3]
    indices = fetched[0]
    assert len(indices) != batch  # the case that tells B from the realised batch apart

    model = instantiate(make_cfg("experiment=quick").model)
    with torch.no_grad():
        for p, s in zip(model.parameters(), start):
            p.copy_(s)
    sums = {}
    for data_seed in (0, 3):
        dataset = instantiate(make_cfg("experiment=quick", f"data.train.seed={data_seed}").data.train)
        sums[data_seed] = clipped_sum(model, rows(dataset.tensors[0][indices], dataset.tensors[1][indices]), clip).grads
    for a0, a3, s0, s3 in zip(after[0.5, 0], after[0.5, 3], sums[0], sums[3]):
        torch.testing.assert_close((a0 - a3).double(), -0.5 * (s0 - s3) / batch, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("flaw, said", [("label", r"has label 12, outside the model's 10 classes"),
                                        ("width", r"does not fit the model: mat1 and mat2 shapes"),
                                        ("unreadable", r"cannot be read \(ValueError: record \d+: bad CRC\)")])
def test_data_that_turns_bad_past_the_pre_run_check_stops_the_run_in_one_line_naming_the_example(tmp_path, flaw, said):
    """Examples from index 1000 on are bad in a dataset read one example at a time (the pre-run check reads the first
    8): the step that meets one ends the run FAILED with one line naming that example's dataset index, exit 1."""
    import re

    from mlflow import MlflowClient

    from tests.conftest import run_cli

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("experiment=quick", "data.train._target_=tests.plugins.LateFlawData", f"+data.train.flaw={flaw}",
                   "+data.train.bad_from=1000", "disable_tqdm=true", f"output_dir={tmp_path / 'run'}",
                   f"tracking.uri={uri}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    found = re.fullmatch(r"error: training stopped at step 1: data\.train \(tests\.plugins\.LateFlawData\): "
                         r"example (\d+) (.*); checkpoints of earlier steps are kept", lines[0])
    assert found and int(found.group(1)) >= 1000 and re.search(said, found.group(2)), lines[0]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    assert run.info.status == "FAILED" and f"example {found.group(1)}" in run.data.tags["error"]


@pytest.mark.parametrize("private, choice, published", [(True, None, False), (True, True, True), (False, None, True),
                                                       (False, False, False)])
def test_the_raw_training_loss_reaches_mlflow_only_where_nothing_private_is_lost_or_the_user_asked(
        make_cfg, mlflow_uri, private, choice, published):
    """A private run's training loss is an exact statistic of its sampled batch, outside what epsilon covers: by
    default it stays on the console and in the result; asked for, it is published and the run says so in a tag."""
    import math

    from mlflow import MlflowClient

    from workbench import train

    extra = ([] if private else ["privacy=none"]) + ([] if choice is None else [f"tracking.log_train_loss={choice}"])
    result = train(make_cfg("experiment=quick", *extra))
    assert len(result.history.loss) == 4 and all(math.isfinite(v) for v in result.history.loss)  # kept in-process
    run = MlflowClient(tracking_uri=mlflow_uri).get_run(result.run_id)
    assert ("loss" in run.data.metrics) == published
    assert run.data.tags.get("non_dp_metrics") == ("loss" if private and published else None)
    assert {"learning_rate", "samples_per_second", "epoch"} <= set(run.data.metrics)


def test_samples_per_second_counts_expected_examples_never_the_realised_batch(make_cfg, mlflow_uri, monkeypatch):
    """The realised size of a Poisson batch is a count over private data with no noise: the throughput line counts
    expected examples (steps x B). With the loop's clock ticking one second per reading, every 5-step window of
    experiment=quick (B = 64) logs exactly 5 x 64, whatever sizes its batches had."""
    import time
    from types import SimpleNamespace

    from mlflow import MlflowClient

    import workbench.trainer
    from workbench import train

    ticks = iter(range(10**6))
    monkeypatch.setattr(workbench.trainer, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks)),
                                                                     monotonic=time.monotonic))
    result = train(make_cfg("experiment=quick"))
    history = MlflowClient(tracking_uri=mlflow_uri).get_metric_history(result.run_id, "samples_per_second")
    assert sorted(m.step for m in history) == [5, 10, 15, 20]
    assert {m.value for m in history} == {5 * 64.0}
