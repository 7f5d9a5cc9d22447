"""The floating-point bound, attacked: each example's contribution as actually added to the step's sum has norm
<= C (1 + RHO) in every mode, route and precision, for inputs crafted to stress rounding (workbench/privacy/clipping/bound.py).

Property-based (hypothesis): a layer under test (every kind bk and Opacus' modes accept, on each of bk's routes) x
every mode that accepts it x fp32/bf16 x an input pattern (plain, cancelling across positions, one huge coordinate,
subnormal, near overflow) at magnitudes from 1e-30 to 1e30. The crafted example is released alone (its contribution
is then the buffer itself) and among benign ones (the difference it makes). Where the inputs are tame, the
contribution must also equal a float64 per-example oracle's clipped gradient. ``WORKBENCH_FUZZ_EXAMPLES`` sets how
many cases hypothesis draws (``make test``: a fixed, derandomised set; ``make fuzz``: many more, random)."""

from __future__ import annotations

import math
import numpy as np
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from tests.oracle import clipped_sum
from workbench.privacy.clipping.bound import RHO
from workbench.privacy.clipping.layers import ConvRule
from workbench.distributed import setup
from workbench.errors import WorkbenchError
from workbench.step import GradientStep

EXAMPLES = int(os.environ.get("WORKBENCH_FUZZ_EXAMPLES", "120"))
FUZZ = "WORKBENCH_FUZZ_EXAMPLES" in os.environ
CLIP = 1.0
MODES = ("bk", "hooks", "functorch", "ew")


class LoRALinear(nn.Module):
    """peft's lora.Linear in miniature: a frozen base, trainable A and B."""

    def __init__(self, d_in, d_out, r=4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.lora_A, self.lora_B = nn.Linear(d_in, r, bias=False), nn.Linear(r, d_out, bias=False)
        nn.init.normal_(self.lora_B.weight)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


class Probe(nn.Module):
    """``body`` on the crafted input, each position's output weighted by a fixed random number (so the layer's output
    gradient varies across positions and cancellation is not exact), pooled, then a trainable Linear head."""

    def __init__(self, body: nn.Module, shape: tuple[int, ...], features: int, positions: int, twice: bool = False,
                 channels_first: bool = False):
        super().__init__()
        self.body, self.shape, self.twice, self.channels_first = body, shape, twice, channels_first
        self.register_buffer("mix", torch.randn(positions, generator=torch.Generator().manual_seed(7)) + 0.5)
        self.head = nn.Linear(features, 3)

    def forward(self, x):
        if self.channels_first:  # the (T, d) example as d channels over T positions (T = the spatial size)
            # contiguous: torch 2.13's CPU GroupNorm backward crashes on this transposed layout, private or not
            x = x.view(len(x), -1, self.shape[0]).transpose(1, 2).contiguous()
        h = self.body(x.reshape(len(x), *self.shape))
        if self.twice:
            h = self.body(torch.tanh(h))
        h = h.flatten(2).transpose(1, 2) if h.dim() > 3 or isinstance(self.body, (nn.Conv1d, nn.Conv2d)) else h
        h = h.reshape(len(x), -1, h.shape[-1])  # (n, positions, features)
        return self.head((h * self.mix[: h.shape[1]].view(1, -1, 1).to(h.dtype)).mean(1))


def _hf_conv1d(d_in: int, d_out: int) -> nn.Module:
    """Hugging Face's Conv1D (GPT-2's projections: a Linear stored transposed); transformers is a dev dependency."""
    from transformers.pytorch_utils import Conv1D

    return Conv1D(d_out, d_in)


class PatchProbe(Probe):
    """A ViT patch embedding (k x k patches, stride k) over 8 patches in a row: the (T, d) example is T = 8 patches of
    d = c x k x k pixels, so values that cancel across positions cancel patch against patch. The default (3 -> 48,
    4x4) keeps a and g (ConvRule's route); a small one (1 -> 8, 2x2) forms its per-sample gradients (PatchConvRule)."""

    def __init__(self, c: int = 3, out: int = 48, k: int = 4):
        super().__init__(nn.Conv2d(c, out, k, stride=k), (c, k, 8 * k), out, 8)
        self.c, self.k = c, k

    def forward(self, x):
        c, k = self.c, self.k
        img = x.view(len(x), 8, c, k, k).permute(0, 2, 3, 1, 4).reshape(len(x), c * k * 8 * k)
        return super().forward(img)


class EmbeddingProbe(nn.Module):
    """Ids with repeats and the padding row; the crafted magnitude is in the table."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(5, 16, padding_idx=0), nn.Linear(16, 3)
        self.register_buffer("mix", torch.randn(12, generator=torch.Generator().manual_seed(7)))

    def forward(self, ids):
        return self.head((self.emb(ids.long().abs() % 5) * self.mix.view(1, -1, 1)).mean(1))


class TiedProbe(EmbeddingProbe):
    """The table tied to an output projection over the positions (GPT-2's wte and lm_head): the example's gradient
    of the one weight is both layers' sum (workbench/privacy/clipping/tied.py)."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(16, 5)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids.long().abs() % 5) * self.mix.view(1, -1, 1)
        return self.head(h.mean(1)) + self.out(h)[:, :, :3].mean(1)


# name -> (model factory, positions T, features d): the input is (T, d) per example, laid out as the model reads it
LAYERS = {
    "linear_rows": (lambda: Probe(nn.Linear(16, 8), (16,), 8, 1), 1, 16),
    "linear_seq_kept": (lambda: Probe(nn.Linear(64, 64), (8, 64), 64, 8), 8, 64),
    "linear_seq_formed": (lambda: Probe(nn.Linear(4, 4), (16, 4), 4, 16), 16, 4),
    "linear_seq_gram": (lambda: Probe(nn.Linear(64, 64), (2, 64), 64, 2), 2, 64),
    "hf_conv1d_seq": (lambda: Probe(_hf_conv1d(64, 64), (8, 64), 64, 8), 8, 64),
    "linear_reused": (lambda: Probe(nn.Linear(32, 32), (6, 32), 32, 6, twice=True), 6, 32),
    "lora": (lambda: Probe(LoRALinear(32, 32), (6, 32), 32, 6), 6, 32),
    "conv1x1_kept": (lambda: Probe(nn.Conv2d(64, 64, 1), (64, 4, 4), 64, 16, channels_first=True), 16, 64),
    "patch_embedding": (lambda: PatchProbe(), 8, 48),
    "patch_formed": (lambda: PatchProbe(1, 8, 2), 8, 4),
    "conv3x3_kept_gram_by_inputs": (lambda: Probe(nn.Conv2d(16, 32, 3, padding=1), (16, 3, 3), 32, 9,
                                                  channels_first=True), 9, 16),
    "conv1d_stride_groups": (lambda: Probe(nn.Conv1d(8, 8, 3, stride=2, groups=2), (8, 16), 8, 7,
                                           channels_first=True), 16, 8),
    "conv3x3_kept_stashed": (lambda: Probe(nn.Conv2d(8, 16, 3), (8, 6, 6), 16, 16, channels_first=True), 36, 8),
    "conv2d_formed": (lambda: Probe(nn.Conv2d(2, 4, 3, padding=1), (2, 6, 6), 4, 36, channels_first=True), 36, 2),
    "layernorm": (lambda: Probe(nn.LayerNorm(8), (6, 8), 8, 6), 6, 8),
    "rmsnorm": (lambda: Probe(nn.RMSNorm(8), (6, 8), 8, 6), 6, 8),
    "groupnorm": (lambda: Probe(nn.GroupNorm(2, 8), (8, 3, 3), 8, 9, channels_first=True), 9, 8),
    "embedding": (EmbeddingProbe, 12, 1),
    "tied": (TiedProbe, 12, 1),
}
IDS = ("embedding", "tied")  # models whose input is ids: the crafted magnitude lives in the table
PATTERNS = ("plain", "cancel", "one_huge", "subnormal", "near_overflow")


def crafted(pattern: str, exponent: int, positions: int, features: int, seed: int) -> torch.Tensor:
    """One example, (T, d) -> flattened: its values stress rounding the way ``pattern`` says."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(positions, features, generator=g, dtype=torch.float64)
    if pattern == "plain":
        x *= 10.0 ** exponent
    elif pattern == "cancel":  # pairs v, -v across positions (sums to 0 exactly), magnitudes log-uniform to 10^exponent
        half = (positions + 1) // 2
        v = (x[:half] * torch.exp(torch.rand(half, features, generator=g, dtype=torch.float64) * abs(exponent) * 2.3))
        v = v.float().double()  # float32 values, so -v is exactly their negation
        x = torch.cat([v, -v])[:positions]
        x = x[torch.randperm(positions, generator=g)]
    elif pattern == "one_huge":
        x.view(-1)[int(torch.randint(0, x.numel(), (1,), generator=g))] = 10.0 ** abs(exponent)
    elif pattern == "subnormal":
        x *= 1e-40
    else:  # near float32's largest value
        x *= 3e38 / float(x.abs().max())
    return x.float().reshape(1, -1)


def _step(model, mode, bf16):
    return GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=CLIP,
                        noise_multiplier=0.0, grad_sample_mode=mode,
                        autocast_dtype=torch.bfloat16 if bf16 else None)


def _benign(name: str, n: int = 6) -> torch.Tensor:
    _, positions, features = LAYERS[name]
    return torch.randn(n, positions * features, generator=torch.Generator().manual_seed(3))


def _released(step, x, y) -> torch.Tensor:
    step((x, y), step=0)
    return step.update.double().clone()


def _oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The definition in float64 (tests/oracle.py): the example's own gradient by autograd, clipped to C, flat."""
    return torch.cat([g.flatten() for g in clipped_sum(model, [(x, y)], CLIP).grads])


def _model(name: str, pattern: str, exponent: int, flat: bool = False) -> nn.Module:
    """``flat``: every position weighted alike, so inputs that cancel across positions cancel in the gradient too."""
    torch.manual_seed(0)
    model = LAYERS[name][0]()
    if flat:
        model.mix.fill_(1.0)
    if name in IDS:  # the crafted magnitude lives in the table the ids read
        with torch.no_grad():
            model.emb.weight.mul_(10.0 ** exponent if pattern != "subnormal" else 1e-40)
    return model


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not FUZZ, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(LAYERS)), mode=st.sampled_from(MODES), bf16=st.booleans(),
       pattern=st.sampled_from(PATTERNS), exponent=st.integers(-30, 30), seed=st.integers(0, 2 ** 16),
       flat=st.booleans())
def test_no_example_is_released_above_the_clip_in_floating_point(name, mode, bf16, pattern, exponent, seed, flat):
    _, positions, features = LAYERS[name]
    x = crafted(pattern, exponent, positions, features, seed)
    if name in IDS:
        x = torch.randint(0, 5, (1, positions), generator=torch.Generator().manual_seed(seed)).float()
    y = torch.tensor([seed % 3])
    try:
        step = _step(_model(name, pattern, exponent, flat), mode, bf16)
        benign = _benign(name) if name not in IDS else torch.randint(0, 5, (6, positions)).float()
        step.check((benign, torch.arange(6) % 3))  # the pre-run check sees real, benign data
    except WorkbenchError:
        # bk accepts every layer here; hooks too, but for the padding row Opacus' embedding rule gets wrong
        assert mode != "bk" and (mode != "hooks" or name in IDS), f"{mode} must accept {name}"
        return
    alone = _released(step, x, y)
    assert float(alone.norm()) <= CLIP * (1 + RHO), f"{name} {mode} bf16={bf16} {pattern} 1e{exponent}"
    # among benign examples: the difference it makes (the benign examples' own rounding: a few units of their sum)
    batch = torch.cat([benign, x])
    with_it = _released(step, batch, torch.cat([torch.arange(6) % 3, y]))
    without = _released(step, benign, torch.arange(6) % 3)
    slack = 8 * 6 * CLIP * 2.0 ** -24
    assert float((with_it - without).norm()) <= CLIP * (1 + RHO) + slack
    tame = pattern == "plain" and abs(exponent) <= 2 and not bf16 and name not in IDS
    if tame:  # where the oracle's own rounding allows, the clipped gradient itself, not just its norm
        expected = _oracle(_model(name, pattern, exponent, flat), x, y)
        torch.testing.assert_close(alone, expected, rtol=1e-3, atol=1e-6 * CLIP)


@pytest.mark.parametrize("mode", MODES)
def test_a_finite_gradient_past_float32s_squares_is_clipped_to_c_not_dropped(mode):
    """Its float32 squared norm overflows (entries near 1e20 and more); in float64 it is finite: clipped to C."""
    name = "linear_rows"
    torch.manual_seed(0)
    model = LAYERS[name][0]()
    step = _step(model, mode, False)
    step.check((_benign(name), torch.arange(6) % 3))
    for scale in (1e20, 1e30, 1e36):
        x = _benign(name, 1) * scale
        with torch.no_grad():  # the least likely class: saturated logits still give a gradient of 1 at them
            y = model(x).argmin(1)
        norm = float(_released(step, x, y).norm())
        assert 0.999 * CLIP <= norm <= CLIP * (1 + RHO), (mode, scale, norm)


def _embedding_cancelling(model: EmbeddingProbe, seed: int) -> torch.Tensor:
    """One id repeated at every position, weighted so the rows cancel exactly in float64 and not in a float32 sum."""
    g = torch.Generator().manual_seed(seed)
    big = float(torch.exp(torch.rand(1, generator=g) * 18 + 5))  # 1e2 .. 1e10
    mix = torch.tensor([big, 1.0, -big, -1.0] * 3)[torch.randperm(12, generator=g)]
    model.mix.copy_(mix)
    return torch.full((1, 12), 1.0)


@pytest.mark.parametrize("name", ["conv1x1_kept", "patch_embedding", "patch_formed", "conv3x3_kept_gram_by_inputs",
                                  "conv3x3_kept_stashed", "linear_seq_kept", "linear_seq_kept_formed", "linear_seq_gram",
                                  "linear_seq_gram32", "embedding", "tied", "hf_conv1d_seq"])
def test_inputs_that_cancel_across_positions_are_released_within_the_clip(name, monkeypatch):
    """The issue's cases: one example whose terms cancel across positions (a 1x1 convolution and a patch embedding on
    the kept/Gram route, a Linear on sequences, an Embedding whose repeated rows cancel). Its exact gradient is near 0,
    its float32 kernel sum is rounding error hundreds of times C (17,000 C measured before the bound); the bound
    counts that error, so it is released within C. ``linear_seq_kept_formed``: the kept Linear with formed norms (the
    route the cost rule leaves to layers called many times), where nothing but the kernel's margin can catch it.
    ``linear_seq_gram`` takes the float64 Gram route of small matrices (bias folded in), ``linear_seq_gram32`` the
    float32 one of large matrices (LinearRule.GRAM64_IF = 0)."""
    from workbench.privacy.clipping.layers import LinearRule

    if name == "linear_seq_kept_formed":
        monkeypatch.setattr(LinearRule, "GRAM_COST", math.inf)
        name = "linear_seq_kept"
    if name == "linear_seq_gram32":
        monkeypatch.setattr(LinearRule, "GRAM64_IF", 0)
        name = "linear_seq_gram"
    assert _worst_cancelling(name) <= CLIP * (1 + RHO)


@pytest.mark.parametrize("name", ["conv1x1_kept", "conv3x3_kept_gram_by_inputs", "conv3x3_kept_stashed"])
def test_kept_convolutions_summed_by_patches_release_cancelling_inputs_within_the_clip(name, monkeypatch):
    """The same on the clipped sum by patches @ scaled g and per-sample gradients formed as g_i @ U_i
    (ConvRule.PATCH_SUM_IF = PATCH_FORM_CHANNELS = 0: every kept call takes them)."""
    monkeypatch.setattr(ConvRule, "PATCH_SUM_IF", 0)
    monkeypatch.setattr(ConvRule, "PATCH_FORM_CHANNELS", 0)
    assert _worst_cancelling(name) <= CLIP * (1 + RHO)


def _worst_cancelling(name: str) -> float:
    """The largest norm released for one example whose terms cancel across positions, over 4 seeds (inf if any is
    not finite)."""
    _, positions, features = LAYERS[name]
    worst = 0.0
    for seed in range(4):
        model = _model(name, "cancel", 0, flat=name not in IDS)
        step = _step(model, "bk", False)
        if name in IDS:
            step.check((torch.randint(0, 5, (6, positions)).float(), torch.arange(6) % 3))
            x = _embedding_cancelling(model, seed)
        else:
            step.check((_benign(name), torch.arange(6) % 3))
            x = crafted("cancel", 12, positions, features, seed)
        norm = float(_released(step, x, torch.tensor([seed % 3])).norm())
        worst = max(worst, norm if math.isfinite(norm) else math.inf)
    return worst


class _Triples(nn.Module):
    """A Linear on 63 positions weighted (3, 3, 1) per triple, a frozen head of few-bit weights: inputs x, y,
    -3 (x + y) give an exact weight gradient of 0, so what a kernel adds is its rounding alone."""

    def __init__(self, positions=63, d=256):
        super().__init__()
        self.positions, self.d = positions, d
        self.body, self.head = nn.Linear(d, d), nn.Linear(d, 3).requires_grad_(False)
        self.register_buffer("mix", torch.tensor([3.0, 3.0, 1.0] * (positions // 3)))
        with torch.no_grad():
            self.head.weight.copy_(torch.randint(-4, 5, (3, d), generator=torch.Generator().manual_seed(1)) / 8)

    def forward(self, x):
        return self.head((self.body(x.view(len(x), self.positions, self.d)) * self.mix.view(1, -1, 1)).mean(1))


def _triples(seed: int, positions=63, d=256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = positions // 3
    e = torch.randint(-6, 6, (k, d), generator=g).double()

    def few_bits():  # 3 significant bits: every sum below is exact in bf16 too
        return (torch.randint(0, 2, (k, d), generator=g) * 2 - 1) * torch.randint(4, 8, (k, d), generator=g) / 4 \
            * 2.0 ** (e + 30)

    x1, x2 = few_bits(), few_bits()
    return torch.stack([x1, x2, -3 * (x1 + x2)], 1).reshape(1, -1).float()


def test_a_nan_in_any_parameter_of_an_example_sent_to_the_float64_route_contributes_zero():
    """The float64 route's norm is scaled by the example's largest entry: Python's max compares a NaN away unless it
    comes first, and min(1, C / NaN) is 1, so an example with a NaN past its first parameter was added unscaled (a
    review found 2.3e36 released at C = 1). Such an example now contributes 0 (a function of it alone), as one whose
    first parameter is NaN did; end to end: two formed Linear sequences whose float32 sum overflows to inf - inf."""
    from workbench.privacy.clipping.bound import add_exact

    for nan_at in range(3):
        grads = {k: torch.tensor([1e30, -2.0, 3.0], dtype=torch.float64) for k in range(3)}
        grads[nan_at][1] = math.nan
        view_of = {k: torch.zeros(3) for k in range(3)}
        assert add_exact(grads, 1.0, view_of) == 0.0
        assert all(not v.any() for v in view_of.values())

    class Crafted(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
            with torch.no_grad():
                self.l1.weight.mul_(1e-4)
                self.l2.weight.mul_(1e3)

        def forward(self, x):
            return self.head(self.l2(self.l1(x.view(len(x), 16, 4))).mean(1))

    torch.manual_seed(0)
    model = Crafted()
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=1.0,
                        noise_multiplier=0.0, grad_sample_mode="bk")
    step.check((torch.randn(6, 64), torch.arange(6) % 3))
    for seed in range(4):
        x = (3e38 * torch.sign(torch.randn(1, 16, 4, generator=torch.Generator().manual_seed(seed)))).view(1, 64)
        with torch.no_grad():
            y = model(x).argmin(1)
        step((x, y), step=0)
        update = step.update.double()
        assert bool(torch.isfinite(update).all()) and float(update.norm()) <= 1.0 * (1 + RHO), seed


@pytest.mark.parametrize("route", ["gram", "formed"])  # the Linear's norms: float32 Gram matrices, or formed
@pytest.mark.parametrize("precision", ["medium", "high"])
def test_a_reduced_float32_matmul_precision_does_not_loosen_the_bound(precision, route, monkeypatch):
    """torch.set_float32_matmul_precision("medium") lets oneDNN (CPUs with AMX/avx512_bf16) and TF32 (CUDA) round
    float32 kernels' inputs: a crafted example measured 59 C that way. The bound's kernels run in true float32 whatever
    the user set, and the user's setting is back afterwards. (On a CPU without bf16 units both settings are exact.)
    The kept Linear takes its norms from float32 Gram matrices (its cost rule's choice here) or, forced, formed."""
    if route == "formed":
        from workbench.privacy.clipping.layers import LinearRule

        monkeypatch.setattr(LinearRule, "GRAM_COST", math.inf)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        worst = 0.0
        for seed in range(3):
            torch.manual_seed(0)
            model = _Triples()
            step = _step(model, "bk", False)
            step.check((torch.randn(6, 63 * 256), torch.arange(6) % 3))
            x = _triples(seed)
            with torch.no_grad():
                y = model(x).argmin(1)
            worst = max(worst, float(_released(step, x, y).norm()))
        assert worst <= CLIP * (1 + RHO)
        assert torch.get_float32_matmul_precision() == precision
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # the flags are global settings: no GPU needed to set them
def test_exact_float32_sets_every_flag_of_the_device_to_ieee_and_restores_it(device):
    """exact_float32 sets each float32 precision flag of the device to "ieee" inside (TF32 and oneDNN's bf16 mode
    round the bound's kernels' inputs) and puts back what the user had set after."""
    from workbench.privacy.clipping.bound import _PRECISION_FLAGS, exact_float32

    flags = list(_PRECISION_FLAGS[device])
    assert flags
    before = [f.fp32_precision for f in flags]
    try:
        for f in flags:
            f.fp32_precision = "tf32" if device == "cuda" else "bf16"
        with exact_float32(torch.device(device)):
            assert [f.fp32_precision for f in flags] == ["ieee"] * len(flags)
        assert [f.fp32_precision for f in flags] == ["tf32" if device == "cuda" else "bf16"] * len(flags)
    finally:
        for f, value in zip(flags, before):
            f.fp32_precision = value


@pytest.mark.parametrize("physical", [3, 512])
def test_removing_one_example_moves_the_release_by_at_most_its_clipped_contribution(physical):
    """DP's sensitivity: neighbouring batches (one example removed), crafted examples whose float32 sums are mostly
    rounding among benign ones, in micro-batches. Each example's factor uses public kernel depths (not the number of
    examples drawn) and ill-conditioned examples are summed alone in float64, so no example's share moves with its
    batch-mates: the release moves by that example's own contribution, up to the float32 sum of the rest."""
    model = _model("embedding", "cancel", 0)
    step = _step(model, "bk", False) if physical == 512 else GradientStep(
        model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=CLIP, noise_multiplier=0.0,
        grad_sample_mode="bk", max_physical_batch_size=physical)
    benign = torch.randint(0, 5, (4, 12), generator=torch.Generator().manual_seed(1)).float()
    step.check((benign, torch.arange(4) % 3))
    for seed in (0, 2):
        x = _embedding_cancelling(model, seed)
        batch, ys = torch.cat([benign[:2], x, benign[2:], x, x]), torch.tensor([0, 1, 2, 0, 1, 2, 0])
        full = _released(step, batch, ys)
        for i in range(len(batch)):
            keep = [j for j in range(len(batch)) if j != i]
            moved = float((full - _released(step, batch[keep], ys[keep])).norm())
            assert moved <= CLIP * (1 + RHO) + 8 * len(batch) * CLIP * 2.0 ** -24, (seed, i, moved)


@pytest.mark.parametrize("dtype", [torch.float64])  # bf16 weights are refused (tests/test_clipping.py)
@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_float64_parameters_keep_the_bound(dtype, mode):
    """A float64 model's rows route and its huge gradients (squares past float64's range) are clipped, not refused or
    dropped. (bf16 weights would round the clipped sum and the count at 2^-9: a private step refuses them.)"""
    torch.manual_seed(0)
    model = LAYERS["linear_rows"][0]().to(dtype)
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=CLIP,
                        noise_multiplier=0.0, grad_sample_mode=mode)
    step.check((_benign("linear_rows").to(dtype), torch.arange(6) % 3))
    for scale in (1.0, 1e3) + ((1e160,) if dtype == torch.float64 else ()):
        x = _benign("linear_rows", 1).to(dtype) * scale
        with torch.no_grad():
            y = model(x).argmin(1)
        norm = float(_released(step, x, y).norm())
        assert 0.98 * CLIP <= norm <= CLIP * (1 + RHO), (scale, norm)


def test_an_examples_clip_factor_does_not_depend_on_how_many_others_were_drawn(monkeypatch):
    """The rounding margins use public depths (max_physical_batch_size, chunked kernels), never the number of examples
    in the micro-batch: otherwise every example's factor would move with its batch-mates' membership."""
    import workbench.privacy.clipping.book_keeping as book_keeping

    factors = []
    real = book_keeping.clip_factors

    def spy(*args, **kwargs):
        factor, rows = real(*args, **kwargs)
        factors.append(factor.double().clone())
        return factor, rows

    monkeypatch.setattr(book_keeping, "clip_factors", spy)
    torch.manual_seed(0)
    step = _step(LAYERS["linear_seq_kept"][0](), "bk", False)
    benign = _benign("linear_seq_kept", 8)
    step.check((benign, torch.arange(8) % 3))
    for others in (0, 1, 7):
        _released(step, benign[: others + 1], torch.arange(others + 1) % 3)
    first = [float(f[0]) for f in factors[-3:]]
    assert first[0] < 1.0  # clipped: the factor carries the margins
    assert first[1] == pytest.approx(first[0], rel=1e-12) and first[2] == pytest.approx(first[0], rel=1e-12)


# The margin's rounding count, from first principles (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1):
# a float32 sum of K products, in any order and blocking, FMA or not, is sum_k p_k (1 + theta_k), |theta_k| <= gamma_K,
# gamma_K = K u / (1 - K u), u = 2^-24; each later rounding of the running value adds one to K. So what a kernel adds
# for example i is within gamma_K S_i of f_i G_i (G_i its exact gradient, S_i = sum_t ||g_t|| ||a_t|| over the
# products that make it), and the promise ||added|| <= C (1 + RHO) needs, whatever the rounding does,
#     f_i (||G_i|| + gamma_K S_i) <= C (1 + RHO),
# with K counted here from the shapes: a clipped-sum kernel over a chunk of m examples of T positions sums m T
# products per entry (m = min(max_physical_batch_size, KERNEL_ROWS // T): chunks keep K public), then each of the
# ceil(batch / m) chunk results is added into the buffer (one rounding each); formed per-sample gradients are summed
# by one matrix-vector product over max_physical_batch_size rows and one add into the buffer (batch + 1). The factor
# f_i the code gives is read off its clip_factors; G_i and S_i are computed here in float64.
BATCH = 4096  # max_physical_batch_size: a deep kernel, so that gamma_K (~1e-4) dwarfs RHO (~1e-6)


class _Seq(nn.Module):
    """One bias-free Linear (d_in -> d_out) on T positions: example i's gradient is sum_t y_t x_t^T exactly, with the
    criterion <out, y> (its output gradient is y itself)."""

    def __init__(self, d_in: int, d_out: int, positions: int, conv: bool = False):
        super().__init__()
        self.d_in, self.positions, self.conv = d_in, positions, conv
        self.layer = nn.Conv1d(d_in, d_out, 1, bias=False) if conv else nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        x = x.view(len(x), self.positions, self.d_in)
        if self.conv:  # the same products as a 1x1 convolution over T positions (ConvRule's kept routes)
            return self.layer(x.transpose(1, 2)).transpose(1, 2)
        return self.layer(x if self.positions > 1 else x[:, 0])


def _inner(out, y):
    return (out.reshape(len(out), -1) * y.reshape(len(out), -1)).sum(1)


def _nearly_cancelling(positions: int, d_in: int, d_out: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One example whose position pairs (x, y), (-x + r/10, y) nearly cancel: S / ||G|| ~ 40, so the kernel's
    rounding bound gamma_K S is a few tenths of a percent of the norm (below the float64 route's 2^-6 threshold)."""
    g = torch.Generator().manual_seed(5)
    half = max(1, positions // 2)
    x = torch.randn(half, d_in, generator=g, dtype=torch.float64)
    y = torch.randn(half, d_out, generator=g, dtype=torch.float64)
    if positions > 1:
        x = torch.cat([x, -x + torch.randn(half, d_in, generator=g, dtype=torch.float64) / 10])
        y = torch.cat([y, y])
    return (x * scale).float().reshape(1, -1), y.float().reshape(1, -1)


def _independent_release_bound(x: torch.Tensor, y: torch.Tensor, positions: int, d_in: int, d_out: int,
                               products_per_term: int) -> tuple[float, float]:
    """||G|| and gamma_K S for the example (float64 from its float32 values)."""
    from workbench.privacy.clipping.bound import U32

    a, g = x.double().view(positions, d_in), y.double().view(positions, d_out)
    exact = float((g.t() @ a).norm())
    magnitude = float((g.norm(dim=1) * a.norm(dim=1)).sum())
    k = products_per_term
    return exact, k * U32 / (1 - k * U32) * magnitude


SHAPES = {  # name -> (mode, positions, d_in, d_out, conv, {(rule class name, attribute): value}, how it sums)
    "linear_rows": ("bk", 1, 64, 32, False, {}, "kernel"),
    "linear_seq_kept": ("bk", 8, 64, 64, False, {}, "kernel"),
    "linear_seq_formed_norms": ("bk", 8, 64, 64, False, {("LinearRule", "GRAM_COST"): math.inf}, "kernel"),
    "linear_seq_gram32": ("bk", 8, 64, 64, False, {("LinearRule", "GRAM64_IF"): 0}, "kernel"),
    "materialised_hooks": ("hooks", 4, 16, 16, False, {}, "formed"),
    "materialised_functorch": ("functorch", 1, 64, 32, False, {}, "formed"),
}


def _gamma(k: int) -> float:
    return k * 2.0 ** -24 / (1 - k * 2.0 ** -24)


@pytest.mark.parametrize("shape", SHAPES)
def test_each_clip_factor_leaves_room_for_an_independently_counted_rounding(shape, monkeypatch):
    """For every kernel shape the routes use, the factor an example gets is small enough for the worst rounding its
    kernel may do, counted here from the shape: f (||G|| + gamma_K S) (1 + gamma_K') <= C (1 + RHO), where a
    clipped-sum kernel (bk's rows and kept routes) has K = m T + ceil(batch / m) and K' = 0, and per-sample gradients
    formed and then summed as they are (Opacus' modes) are clipped by their own norm (K = 0) and K' = batch + 1. A margin too small by a constant factor (or a count off by a factor) gives a larger factor than
    that and fails, however tame the actual rounding of the input."""
    import workbench.privacy.clipping.book_keeping as book_keeping
    import workbench.privacy.clipping.layers as layers
    import workbench.privacy.clipping.opacus_modes as opacus_modes
    from workbench.privacy.clipping.rows import LinearRows

    mode, positions, d_in, d_out, conv, overrides, sums = SHAPES[shape]
    for (rule, name), value in overrides.items():
        monkeypatch.setattr(getattr(layers, rule), name, value)
    factors = []

    def spying(real, returns_pair):
        def spy(*args, **kwargs):
            out = real(*args, **kwargs)
            factor, rows = out if returns_pair else (out, None)
            if factor is not None:
                factors.append((factor.double().clone(), rows))
            return out
        return spy

    for module in (book_keeping, opacus_modes):
        monkeypatch.setattr(module, "clip_factors", spying(module.clip_factors, True))
    monkeypatch.setattr(LinearRows, "add", spying(LinearRows.add, False))  # bk's lean path for Linear rows
    torch.manual_seed(0)
    model = _Seq(d_in, d_out, positions, conv)
    step = GradientStep(model, _inner, setup("gloo"), max_grad_norm=CLIP, noise_multiplier=0.0,
                        grad_sample_mode=mode, max_physical_batch_size=BATCH)
    step.check((torch.randn(4, positions * d_in), torch.randn(4, positions * d_out)))
    if sums == "kernel":
        x, y = _nearly_cancelling(positions, d_in, d_out, scale=1.0)
    else:  # formed gradients are clipped by their own norm, which holds their formation's rounding: inputs that do not
        # cancel keep it within a few u of ||G|| (the code's other margins, ~1e-5, cover that)
        x, y = torch.randn(1, positions * d_in), torch.randn(1, positions * d_out)
    exact, _ = _independent_release_bound(x, y, positions, d_in, d_out, 1)
    x = (x.double() * (10 * CLIP / exact)).float()  # ||G|| ~ 10 C: clipped
    factors.clear()
    released = _released(step, x, y)
    (factor, rows), = factors
    assert rows is None or not bool(rows[0]), "the example took the float64 route: nothing of the margin is measured"
    if sums == "kernel":
        chunk = min(BATCH, max(1, layers.KERNEL_ROWS // positions))
        formed, summed = chunk * positions + math.ceil(BATCH / chunk), 0
    else:
        formed, summed = 0, BATCH + 1
    exact, rounding = _independent_release_bound(x, y, positions, d_in, d_out, formed)
    f = float(factor[0])
    assert 0 < f < 1 and float(released.norm()) <= CLIP * (1 + RHO)
    assert f * (exact + rounding) * (1 + _gamma(summed)) <= CLIP * (1 + RHO), (shape, f, exact, rounding)


# The other layer families' routes, counted the same way from their shapes (L output positions or T ids per example,
# m = min(BATCH, KERNEL_ROWS // L) examples per kernel call, BATCH = max_physical_batch_size):
# - a kept convolution's clipped sum (the weight-gradient kernel, or patches @ scaled g: the same products) and an
#   Embedding's (index_add_ of the scaled rows): each term is rounded once when g is scaled by f (float32), then by its
#   chunk's reduction over m L terms (at most m L roundings: Higham 3.1), then once by each of the ceil(BATCH / m)
#   chunk results added into the buffer: K = 1 + m L + ceil(BATCH / m), K' = 0, S = sum_l ||g_l|| ||U_l|| (U_l the
#   input patch output position l reads; an Embedding's a_t is one-hot: S = sum_t ||g_t||);
# - a convolution that keeps its formed per-sample gradients W_i for the sum (ConvRule.STASH_IF): each entry of W_i is a
#   float32 sum of L products (K = L, so ||W_i|| <= ||G_i|| + gamma_L S_i), then one matrix-vector product over at most
#   BATCH rows and one add into the buffer (K' = BATCH + 1);
# - formed gradients summed as they are (PatchConvRule's bmm over L patches, LayerNorm / GroupNorm's affine
#   gradients): they are clipped by their own norm, so what must hold is f ||W_i|| (1 + gamma_{BATCH+1}) <= C (1 + RHO)
#   with ||W_i|| measured in float64 on the tensor actually summed (captured), and W_i within gamma_L S_i of the
#   float64 gradient (checks the capture is the example's gradient).
class _Conv(nn.Module):
    """One bias-free convolution; the criterion <out, y> makes its output gradient y itself."""

    def __init__(self, layer: nn.Module, shape: tuple[int, ...]):
        super().__init__()
        self.layer, self.shape = layer, shape

    def forward(self, x):
        return self.layer(x.view(len(x), *self.shape))


class _Ids(nn.Module):
    """An Embedding on ids sent as floats (the step's batch)."""

    def __init__(self, layer: nn.Embedding):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.long())


def _pairs(positions: int, d: int, g: torch.Generator) -> torch.Tensor:
    """(positions, d) float64 rows in pairs y, -y + r/10, shuffled: their sum is ~1/40 of the sum of their norms."""
    y = torch.randn(positions // 2, d, generator=g, dtype=torch.float64)
    rows = torch.cat([y, -y + torch.randn(positions // 2, d, generator=g, dtype=torch.float64) / 10])
    return rows[torch.randperm(positions, generator=g)]


def _conv_inputs(shape, out_shape, cancel: bool, g: torch.Generator):
    """x: one channel vector at every pixel (plus a little noise), so that every patch U_l is nearly the same and the
    pairs of output gradients cancel in G = sum_l g_l U_l^T; or plain Gaussian inputs."""
    c, h, w = shape
    if cancel:
        x = torch.randn(c, 1, 1, generator=g, dtype=torch.float64) + torch.randn(c, h, w, generator=g,
                                                                                   dtype=torch.float64) / 100
        y = _pairs(out_shape[1] * out_shape[2], out_shape[0], g).t()
    else:
        x, y = torch.randn(c, h, w, generator=g, dtype=torch.float64), torch.randn(*out_shape, generator=g,
                                                                                  dtype=torch.float64)
    return x.float().reshape(1, -1), y.float().reshape(1, -1)


def _conv_exact(m: nn.Conv2d, shape, x, y):
    """(G flat, S, L) in float64 from the float32 inputs, by unfolding the patches."""
    u = F.unfold(x.double().view(1, *shape), m.kernel_size, m.dilation, m.padding, m.stride)[0]  # (p, L)
    g = y.double().view(m.out_channels, -1)
    return (g @ u.t()).flatten(), float((g.norm(dim=0) * u.norm(dim=0)).sum()), u.shape[1]


def _ids_inputs(g: torch.Generator, positions: int = 16, d: int = 16):
    """One id repeated at every position, its output gradient rows in nearly cancelling pairs (G = their sum)."""
    return torch.full((1, positions), 1.0), _pairs(positions, d, g).float().reshape(1, -1)


def _ids_exact(m: nn.Embedding, x, y):
    g = y.double().view(x.shape[1], -1)
    table = torch.zeros(m.num_embeddings, g.shape[1], dtype=torch.float64).index_add_(0, x[0].long(), g)
    return table.flatten(), float(g.norm(dim=1).sum()), x.shape[1]


def _norm_inputs(shape, g: torch.Generator):
    """Plain Gaussian inputs: a formed gradient's margin is relative to its own norm, cancellation does not move it."""
    return (torch.randn(1, math.prod(shape), generator=g), torch.randn(1, math.prod(shape), generator=g))


def _layernorm_exact(m: nn.LayerNorm, shape, x, y):
    """Weight and bias gradients sum_t g_t x_hat_t, sum_t g_t (x_hat in float64), S = sum_t ||g_t|| (||x_hat_t|| + 1)."""
    a, g = x.double().view(shape), y.double().view(shape)
    hat = F.layer_norm(a, m.normalized_shape, eps=m.eps)
    s = float((g.norm(dim=-1) * (hat.norm(dim=-1) + 1)).sum())
    return torch.cat([(g * hat).sum(0), g.sum(0)]), s, shape[0]


def _groupnorm_exact(m: nn.GroupNorm, shape, x, y):
    a, g = x.double().view(1, *shape), y.double().view(1, *shape)
    hat = F.group_norm(a, m.num_groups, eps=m.eps)
    per = lambda t: t.flatten(2)[0]  # noqa: E731 - (channels, positions)
    s = float((per(g).norm(dim=0) * (per(hat).norm(dim=0) + 1)).sum())
    return torch.cat([per(g * hat).sum(1), per(g).sum(1)]), s, math.prod(shape[1:])


_NO_STASH = {("ConvRule", "STASH_IF"): 0}
ROUTES = {  # name -> (model factory, input shape, output shape, {(rule class, attribute): value}, how it sums)
    # 3x3, no padding (not a patch convolution), 16 -> 64 channels on 6x6: a and g (576 + 1024) < the weight's 9216
    "conv2d_kernel_formed_norms": (lambda: nn.Conv2d(16, 64, 3, bias=False), (16, 6, 6), (64, 4, 4),
                                   {**_NO_STASH, ("ConvRule", "PATCH_SUM_IF"): math.inf,
                                    ("ConvRule", "GRAM_IF"): math.inf}, "kernel"),
    "conv2d_kernel_gram": (lambda: nn.Conv2d(16, 64, 3, bias=False), (16, 6, 6), (64, 4, 4),
                           {**_NO_STASH, ("ConvRule", "PATCH_SUM_IF"): math.inf}, "kernel"),
    "conv2d_patches_sum": (lambda: nn.Conv2d(16, 64, 3, bias=False), (16, 6, 6), (64, 4, 4),
                           {**_NO_STASH, ("ConvRule", "PATCH_SUM_IF"): 0, ("ConvRule", "GRAM_IF"): math.inf}, "kernel"),
    "conv2d_stash": (lambda: nn.Conv2d(16, 64, 3, bias=False), (16, 6, 6), (64, 4, 4),
                     {("ConvRule", "STASH_IF"): math.inf, ("ConvRule", "GRAM_IF"): math.inf}, "stash"),
    # a patch convolution (2x2, stride 2) 1 -> 8 on 8x8: 32 weights per example, formed (PatchConvRule)
    "patch_conv_formed": (lambda: nn.Conv2d(1, 8, 2, stride=2, bias=False), (1, 8, 8), (8, 4, 4), {}, "formed"),
    "embedding": (lambda: nn.Embedding(5, 16), (16,), (16, 16), {}, "kernel"),
    "layernorm": (lambda: nn.LayerNorm(8), (6, 8), (6, 8), {}, "formed"),
    "groupnorm": (lambda: nn.GroupNorm(2, 8), (8, 3, 3), (8, 3, 3), {}, "formed"),
}


def _route_case(name: str, g: torch.Generator):
    """(model, layer, x, y, exact) for a route: exact(x, y) -> (G flat, S, positions) in float64."""
    factory, shape, out_shape, _, sums = ROUTES[name]
    torch.manual_seed(0)
    layer = factory()
    if isinstance(layer, nn.Embedding):
        x, y = _ids_inputs(g)
        return _Ids(layer), layer, x, y, lambda x, y: _ids_exact(layer, x, y)
    if isinstance(layer, nn.Conv2d):
        x, y = _conv_inputs(shape, out_shape, sums != "formed", g)
        return _Conv(layer, shape), layer, x, y, lambda x, y: _conv_exact(layer, shape, x, y)
    x, y = _norm_inputs(shape, g)
    exact = _layernorm_exact if isinstance(layer, nn.LayerNorm) else _groupnorm_exact
    return _Conv(layer, shape), layer, x, y, lambda x, y: exact(layer, shape, x, y)


@pytest.mark.parametrize("route", ROUTES)
def test_each_other_routes_clip_factor_leaves_room_for_an_independently_counted_rounding(route, monkeypatch):
    """Convolutions (kernel, patches @ g, stashed formed gradients, a patch convolution's formed ones), Embedding and
    the normalisation layers: the factor an example gets leaves room for the rounding its route may do, counted above
    from the shape (K, K' in the comment before _Conv), on inputs whose per-example norm is ~10 C and, on kernel
    routes, whose terms cancel (S ~ 40 ||G||)."""
    import workbench.privacy.clipping.book_keeping as book_keeping
    import workbench.privacy.clipping.layers as layers
    import workbench.privacy.clipping.layers.conv as conv

    *_, overrides, sums = ROUTES[route]
    for (rule, attribute), value in overrides.items():
        monkeypatch.setattr(getattr(layers, rule), attribute, value)
    factors, summed = [], []

    def clip_spy(*args, **kwargs):
        factor, rows = real_clip(*args, **kwargs)
        factors.append((factor.double().clone(), rows))
        return factor, rows

    def sum_spy(real):
        def spy(t, factor):
            summed.append(t.double().clone())
            return real(t, factor)
        return spy

    real_clip = book_keeping.clip_factors
    monkeypatch.setattr(book_keeping, "clip_factors", clip_spy)
    monkeypatch.setattr(book_keeping, "weighted_sum", sum_spy(book_keeping.weighted_sum))
    monkeypatch.setattr(conv, "weighted_sum", sum_spy(conv.weighted_sum))
    model, layer, x, y, exact = _route_case(route, torch.Generator().manual_seed(11))
    step = GradientStep(model, _inner, setup("gloo"), max_grad_norm=CLIP, noise_multiplier=0.0,
                        grad_sample_mode="bk", max_physical_batch_size=BATCH)
    ids = isinstance(layer, nn.Embedding)
    benign = torch.randint(0, 5, (4, x.shape[1])).float() if ids else torch.randn(4, x.shape[1])
    step.check((benign, torch.randn(4, y.shape[1])))
    norm, _, _ = exact(x, y)
    y = (y.double() * (10 * CLIP / float(norm.norm()))).float()  # ||G|| ~ 10 C: clipped (G is linear in g)
    factors.clear()
    summed.clear()
    released = _released(step, x, y)
    (factor, rows), = factors
    assert rows is None or not bool(rows[0]), "the example took the float64 route: nothing of the margin is measured"
    G, S, positions = exact(x, y)
    G = float(G.norm())
    f = float(factor[0])
    assert 0 < f < 1 and float(released.norm()) <= CLIP * (1 + RHO)
    if sums == "kernel":
        chunk = min(BATCH, max(1, layers.KERNEL_ROWS // positions))
        k = 1 + chunk * positions + math.ceil(BATCH / chunk)
        assert S > 20 * G  # the inputs cancel: the margin is most of what bounds the release
        assert f * (G + _gamma(k) * S) <= CLIP * (1 + RHO), (route, f, G, S, k)
        return
    (w,) = summed  # the formed per-sample gradients the release is the sum of
    w = float(w[0].norm())
    assert abs(w - G) <= _gamma(positions) * S + 1e-6 * G  # (x_hat's own rounding: a few u of it)
    assert f * w * (1 + _gamma(BATCH + 1)) <= CLIP * (1 + RHO), (route, f, w)
    if sums == "stash":  # from the inputs alone: ||W|| <= ||G|| + gamma_L S
        assert S > 20 * G
        assert f * (G + _gamma(positions) * S) * (1 + _gamma(BATCH + 1)) <= CLIP * (1 + RHO), (route, f, G, S)


def _rounding_up(first: float, terms: int) -> np.ndarray:
    """float32 terms (first, then ~1 each) chosen one at a time so that every partial sum of a sequential float32 sum
    rounds up by almost half an ulp (the largest one rounding can add), their norms all ~1 (Cauchy-Schwarz tight)."""
    out = np.empty(terms, dtype=np.float32)
    out[0] = s = np.float32(first)
    candidates = np.float32(1) + np.arange(2 ** 13, dtype=np.float32) * np.float32(2.0 ** -23)  # 1 .. 1 + 2^-10
    for t in range(1, terms):
        up = (s + candidates).astype(np.float64) - (np.float64(s) + candidates.astype(np.float64))
        out[t] = candidates[int(np.argmax(up))]
        s = np.float32(s + out[t])
    return out


def test_a_kernel_sum_whose_every_partial_sum_rounds_up_is_clipped_within_the_clip():
    """The worst case approached: one id looked up at T = 2048 positions (an Embedding's index_add_ adds the rows one
    after another: a sequential float32 sum), output gradient rows (v_t, v_t, v_t, v_t) chosen so that every partial
    sum rounds up by almost half an ulp. Counted from the shape (max_physical_batch_size 1: one chunk of one example)
    K = 1 + T + 1 = 2050 roundings a term, so gamma_K S bounds the error; a sequential sum only reaches about a third
    of it (a term added at step t is rounded T - t times, and half an ulp of s is u s to u s / 2). Unclipped (a
    quarter of the height, exact: powers of two commute with rounding) the measured error is that third; at full
    height ||G|| < C, yet the unclipped release would be past C (1 + RHO): the factor must be below 1 and the release
    within C (1 + RHO). With a margin a quarter of gamma_K S (fp-kernel-count-quartered) the factor is 1 and it is
    not."""
    positions, scale = 2048, 2.0 ** -11  # ||row sum|| = 2 sum_t v_t 2^-12, ~1 = C
    for first in np.linspace(0.6, 1.0, 81):  # the first term tunes ||G|| into the window (a handful of tries)
        v = _rounding_up(float(first), positions)
        exact = float(v.astype(np.float64).sum()) * scale  # ||G||: exact in float64 (2048 24-bit terms)
        unclipped = float(np.float32(np.cumsum(v, dtype=np.float32)[-1])) * scale  # sequential float32 running sums
        if CLIP * (1 + 4 * RHO) < unclipped and exact * (1 + _gamma(2050) / 4) < CLIP * (1 - 4 * RHO):
            break
    else:
        pytest.fail("no first term puts ||G|| in the window")
    s = exact  # S = sum_t ||g_t|| = ||G||: every row points the same way
    model = _Ids(nn.Embedding(3, 4))
    step = GradientStep(model, _inner, setup("gloo"), max_grad_norm=CLIP, noise_multiplier=0.0,
                        grad_sample_mode="bk", max_physical_batch_size=1)
    step.check((torch.randint(0, 3, (2, positions)).float(), torch.randn(2, positions * 4)))
    ids = torch.full((1, positions), 1.0)
    rows = torch.from_numpy(v).view(positions, 1).expand(positions, 4) * 2.0 ** -12  # exact
    low = _released(step, ids, (rows / 4).reshape(1, -1))  # ||G|| / 4: not clipped, f = 1
    measured = float(low.norm()) - exact / 4
    assert float(low.norm()) == pytest.approx(unclipped / 4, rel=1e-12)  # bit for bit: sequential, as built
    assert 0.3 * _gamma(2050) * s / 4 <= measured <= _gamma(2050) * s / 4  # a third of the counted bound, within it
    released = _released(step, ids, rows.reshape(1, -1))
    assert float(released.norm()) <= CLIP * (1 + RHO) < unclipped  # clipped, and had to be
