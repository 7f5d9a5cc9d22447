import pytest
import torch

from tests.oracle import CLIPPED_RTOL, clipped_sum, rows
from torch import nn

from workbench.distributed import setup
from workbench.errors import WorkbenchError
from workbench.models import prepare_model
from workbench.step import GradientStep


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(n=13, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("mode", ["bk", "hooks", "functorch", "ew"])
@pytest.mark.parametrize("physical", [4, 64])
def test_clipped_sum_matches_per_example_loop(mode, physical):
    d = setup("gloo")
    x, y = _batch()
    clip = 0.5
    expected, clipped = clipped_sum(_model(), rows(x, y), clip)
    model = _model()
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=clip, noise_multiplier=0.0,
                        grad_sample_mode=mode, max_physical_batch_size=physical)
    loss_sum, count = step((x, y), step=0)
    assert count == len(y)
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-4, atol=1e-5)
    assert clipped > 0  # clipping really bit: some per-example norms exceed the bound here


def test_noise_std_is_sigma_times_clip_and_reproducible():
    d = setup("gloo")
    model = nn.Linear(100, 50)
    sigma, clip = 1.3, 0.7
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=clip, noise_multiplier=sigma)
    samples = []
    for s in range(20):
        step(None, step=s)  # an empty Poisson batch: the gradient is pure noise
        samples.append(torch.cat([p.grad.flatten() for p in step.params]))
    noise = torch.stack(samples)
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.02)
    assert abs(float(noise.mean())) < 0.01
    step(None, step=3)
    assert torch.equal(torch.cat([p.grad.flatten() for p in step.params]), samples[3])


def test_unused_parameters_train_with_zero_clipped_gradient():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(6, 3), nn.Linear(6, 3)

        def forward(self, x):
            return self.used(x)

    d = setup("gloo")
    model = TwoHeads()
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=1.0, noise_multiplier=0.0)
    step(_batch(), step=0)
    assert float(model.unused.weight.grad.abs().sum()) == 0.0
    assert float(model.used.weight.grad.abs().sum()) > 0.0


def test_models_dp_cannot_handle_are_refused_with_a_fix():
    with pytest.raises(WorkbenchError, match="BatchNorm.*privacy.fix_model=true replaces it"):
        prepare_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), private=True, fix=False)
    prepare_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), private=False, fix=False)
    with pytest.raises(WorkbenchError, match="launcher=local"):
        prepare_model(nn.DataParallel(nn.Linear(4, 4)), private=False)


def test_auto_grad_sample_mode_picks_the_fastest_that_fits():
    from workbench.models import MLP, SmallCNN
    from workbench.privacy.clipping import fastest_grad_sample_mode

    assert fastest_grad_sample_mode(MLP()) == "bk"
    assert fastest_grad_sample_mode(SmallCNN()) == "bk"
    assert fastest_grad_sample_mode(nn.Sequential(nn.Linear(4, 4), nn.GRU(4, 4))) == "hooks"
    d = setup("gloo")
    step = GradientStep(MLP(), nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=1.0, noise_multiplier=0.0,
                        grad_sample_mode="auto")
    assert step.mode == "bk"
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    assert fastest_grad_sample_mode(tied) == "ew"  # expanded weights sums a tied weight's uses per sample


class _SequenceModel(nn.Module):
    """Linear layers on (B, T, features) inputs, one of them called twice, one bias frozen: the cases book-keeping
    handles beyond a plain MLP, at two widths."""

    def __init__(self, t, wide):
        super().__init__()
        torch.manual_seed(0)
        self.t, d = t, 40 if wide else 5
        self.a, self.b, self.head = nn.Linear(6, d), nn.Linear(d, d), nn.Linear(d, 3)
        self.b.bias.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.a(x.view(len(x), self.t, -1)))
        h = torch.tanh(self.b(torch.tanh(self.b(h))))
        return self.head(h.mean(1))


@pytest.mark.parametrize("t,wide", [(1, False), (3, False), (3, True)])
def test_book_keeping_clips_sequences_and_reused_layers_exactly(t, wide):
    x, y = torch.randn(13, 6 * t, generator=torch.Generator().manual_seed(2)) * 3, torch.randint(0, 3, (13,))
    expected = clipped_sum(_SequenceModel(t, wide), rows(x, y), 0.5).grads  # over the trainable parameters only
    step = GradientStep(_SequenceModel(t, wide), nn.CrossEntropyLoss(reduction="none"), setup("gloo"),
                        max_grad_norm=0.5, noise_multiplier=0.0, grad_sample_mode="bk")
    step((x, y), step=0)
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-5)


def test_book_keeping_refuses_what_it_cannot_clip():
    d = setup("gloo")
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    for model, match in ((nn.Sequential(nn.Conv3d(1, 1, 3)), "no rule for Conv3d"), (tied, "tied weights")):
        with pytest.raises(WorkbenchError, match=match):
            GradientStep(model, nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=1.0, noise_multiplier=0.0,
                         grad_sample_mode="bk")


class _TwoHeadsSum(nn.Module):
    """z = a(x) + b(tanh x): autograd hands both layers the same gradient tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x):
        return self.a(x) + self.b(torch.tanh(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_book_keeping_layers_sharing_one_output_gradient_and_float64(dtype):
    x, y = _batch()
    x = x.to(dtype)
    expected = clipped_sum(_TwoHeadsSum(), rows(x, y), 0.5).grads
    step = GradientStep(_TwoHeadsSum().to(dtype), nn.CrossEntropyLoss(reduction="none"), setup("gloo"),
                        max_grad_norm=0.5, noise_multiplier=0.0, grad_sample_mode="bk")
    step((x, y), step=0)  # the first batch is also checked against autograd's own sums
    step((x, y), step=1)  # every later one is not: this is the steady-state path
    for p, e in zip(step.params, expected):
        assert p.grad.dtype == dtype
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-4, atol=1e-5)


class _TimeMajor(nn.Module):
    """A (T, B, d) layer input: with T equal to the batch, only a batch-first probe can tell."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.head = nn.Linear(2, 4), nn.Linear(4, 3)

    def forward(self, x):  # x: (B, 13 * 2) -> (13, B, 2): time-major
        h = torch.tanh(self.fc(x.view(len(x), 13, 2).transpose(0, 1)))
        return self.head(h.mean(0))


class _FunctionalUse(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)) + x @ self.fc.weight.T)  # fc.weight also used outside fc's call


class _Lora(nn.Linear):
    def __init__(self):
        super().__init__(6, 3)
        self.lora = nn.Parameter(torch.zeros(3, 6))

    def forward(self, x):
        return nn.functional.linear(x, self.weight + self.lora, self.bias)


class _CentredLogits(nn.Module):
    """Mixes examples after the last Linear (logits centred over the batch): no layer-level check can see it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        z = self.fc(x)
        return z - z.mean(0) if self.training else z  # and only in training mode


@pytest.mark.parametrize("model, x, message", [
    (_TimeMajor, torch.randn(13, 26), "example 0's gradient of 'fc.weight' is not its own"),
    (_FunctionalUse, torch.randn(13, 6), "gradient of 'fc.weight' is not its own"),
    (_CentredLogits, torch.randn(13, 6), "the model mixes examples"),
    (_Lora, torch.randn(13, 6), "no rule for _Lora"),
])
def test_book_keeping_refuses_what_it_would_clip_wrong(model, x, message):
    from workbench.privacy.clipping import fastest_grad_sample_mode

    y = torch.randint(0, 3, (13,))
    with pytest.raises(WorkbenchError, match=message):
        # handed over in eval mode: the check must still look at the mode the model trains in
        step = GradientStep(model().eval(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=1.0,
                            noise_multiplier=0.0, grad_sample_mode="bk")
        step.check((x, y))
    if model is _Lora:  # auto falls back to the mode that handles a Linear subclass: Opacus' hooks
        assert fastest_grad_sample_mode(model()) == "hooks"


def test_step_refuses_a_batch_mean_loss_and_a_model_without_trainable_parameters():
    d = setup("gloo")
    for mode in ("bk", "hooks"):
        step = GradientStep(_model(), nn.CrossEntropyLoss(), d, max_grad_norm=1.0, noise_multiplier=0.0,
                            grad_sample_mode=mode)
        with pytest.raises(WorkbenchError, match="one loss per example"):
            step(_batch(), step=0)
    frozen = _model().requires_grad_(False)
    with pytest.raises(WorkbenchError, match="no trainable parameters"):
        GradientStep(frozen, nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=1.0, noise_multiplier=0.0)


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
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
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
