"""The DP step (workbench/step.py, GradientStep): one logical step's clipped sum against the per-example definition
(tests/oracle.py) in every mode and micro-batching, book-keeping on sequences, reused and shared layers, and the
models and losses it refuses."""

import pytest
import torch
from torch import nn

from tests.oracle import CLIPPED_RTOL, clipped_sum, rows
from workbench.distributed import setup
from workbench.errors import WorkbenchError
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
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # two Linears: only an Embedding tied to a Linear is clipped
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
    for dtype in (torch.bfloat16, torch.float16):  # the clipped sum, noise and count would round at 2^-9 (2^-11)
        with pytest.raises(WorkbenchError, match=f"are {dtype}: DP-SGD needs float32"):
            GradientStep(_model().to(dtype), nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=1.0,
                         noise_multiplier=0.0)
    GradientStep(_model().to(torch.bfloat16), nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=None,
                 noise_multiplier=0.0)  # non-private: no bound to keep


@pytest.mark.parametrize("mode", ["bk", "hooks", None])
@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_a_parameter_frozen_or_unfrozen_after_the_step_was_built_is_refused_before_any_work(mode, change):
    """The buffer, the noise and the optimizer cover the parameters trainable when the step was built: one frozen since
    would still be noised and stepped by the optimizer, one unfrozen since never trained. Either is refused, naming
    the parameter, before the step adds anything; restoring it lets training go on."""
    d = setup("gloo")
    model = _model()
    model[2].bias.requires_grad_(change == "freeze")
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=None if mode is None else 1.0,
                        noise_multiplier=1.0, grad_sample_mode=mode or "bk")
    step(_batch(), step=0)
    before = step.flat.clone()
    model[2].bias.requires_grad_(change != "freeze")
    with pytest.raises(WorkbenchError, match=f"parameter '2.bias' was {dict(freeze='frozen', unfreeze='unfrozen')[change]} after the DP step was built"):
        step(_batch(), step=1)
    assert torch.equal(step.flat, before)  # before any work: the last step's gradients and totals as they were
    model[2].bias.requires_grad_(change == "freeze")
    step(_batch(), step=2)
