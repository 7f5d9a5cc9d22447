"""Per-layer clipping, Opacus style: for every layer type and every grad_sample_mode that accepts it, the clipped sum
of one step equals the definition - a per-example autograd loop, flat L2 clipping over all trainable parameters.

Modes are asked, not assumed: a mode that refuses a model (a one-line WorkbenchError, before training) is skipped for
it, saying so; a mode that accepts it must be exact. ``hooks`` (Opacus) and ``auto`` must accept every case here.
"""

import math

import pytest
import torch
from torch import nn

from tests.oracle import clipped_sum, rows
from workbench.config import GRAD_SAMPLE_MODES
from workbench.distributed import setup
from workbench.errors import WorkbenchError
from workbench.step import GradientStep

CLASSES, BATCH, PHYSICAL, CLIP = 3, 7, 4, 0.05  # 7 examples in micro-batches of 4 and 3; the clip binds for most


class Probe(nn.Module):
    """``body`` (the layer under test, once or twice), flattened, then a Linear head."""

    def __init__(self, body: nn.Module, features: int, reuse: bool = False):
        super().__init__()
        self.body, self.reuse = body, reuse
        self.head = nn.Linear(features, CLASSES)

    def forward(self, x):
        h = self.body(x)
        if self.reuse:  # the same weights a second time: per-example gradients must sum both uses
            h = self.body(torch.tanh(h))
        return self.head(torch.tanh(h).flatten(1))


class TwoEmbeddings(nn.Module):
    """One Embedding looked up for two token streams (a reused table, as tied input/output embeddings reuse it)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 4)

    def forward(self, x):
        return self.emb(x[:, :3]) + self.emb(x[:, 3:])


def _hf_conv1d(d_in, d_out, bias_only=False):
    """Hugging Face's Conv1D (GPT-2's projections, a Linear stored transposed); transformers is a dev dependency.
    ``bias_only``: its weight frozen (BitFit)."""
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(d_out, d_in)
    layer.weight.requires_grad_(not bias_only)
    return layer


def _tokens(n, length):
    # few tokens, so that examples share rows of the table (the collisions per-sample norms must get right)
    return torch.randint(0, 11, (n, length), generator=torch.Generator().manual_seed(4))


def _floats(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(4)) * 2


# name -> (model factory, input); each factory seeds itself, so every mode and the reference start alike
CASES = {
    "linear": (lambda: Probe(nn.Linear(5, 6), 6), _floats(BATCH, 5)),
    "linear_sequence": (lambda: Probe(nn.Linear(5, 6), 4 * 6), _floats(BATCH, 4, 5)),
    "linear_reused": (lambda: Probe(nn.Linear(5, 5), 4 * 5, reuse=True), _floats(BATCH, 4, 5)),
    "linear_sequence_gram": (lambda: Probe(nn.Linear(16, 24), 2 * 24), _floats(BATCH, 2, 16)),  # bk: Gram route
    # bk: one row per example; formed per-sample gradients; kept (a square weight: a transposed sum would pass shapes)
    "hf_conv1d": (lambda: Probe(_hf_conv1d(5, 6), 6), _floats(BATCH, 5)),
    "hf_conv1d_sequence": (lambda: Probe(_hf_conv1d(5, 6), 4 * 6), _floats(BATCH, 4, 5)),
    "hf_conv1d_sequence_kept": (lambda: Probe(_hf_conv1d(16, 16), 2 * 16), _floats(BATCH, 2, 16)),
    "hf_conv1d_bias_only": (lambda: Probe(_hf_conv1d(5, 6, bias_only=True), 6), _floats(BATCH, 5)),
    "conv1d": (lambda: Probe(nn.Conv1d(2, 3, 3, padding=1), 3 * 6), _floats(BATCH, 2, 6)),
    "conv1d_reused": (lambda: Probe(nn.Conv1d(3, 3, 3, padding=1), 3 * 6, reuse=True), _floats(BATCH, 3, 6)),
    "conv2d": (lambda: Probe(nn.Conv2d(2, 4, 3, padding=1, stride=2), 4 * 3 * 3), _floats(BATCH, 2, 5, 5)),
    "conv2d_reused": (lambda: Probe(nn.Conv2d(2, 2, 3, padding=1), 2 * 4 * 4, reuse=True), _floats(BATCH, 2, 4, 4)),
    # patch convolutions (kernel == stride): bk's PatchConvRule forms them as a Linear on patches (5 -> 2 patches: the
    # last row and column, which the layer ignores, cut); the wide one keeps a and g (ConvRule's kept route)
    "conv2d_patches": (lambda: Probe(nn.Conv2d(2, 3, 2, stride=2), 3 * 2 * 2), _floats(BATCH, 2, 5, 5)),
    "conv1d_patches": (lambda: Probe(nn.Conv1d(2, 3, 3, stride=3), 3 * 2), _floats(BATCH, 2, 7)),
    "conv2d_patches_kept": (lambda: Probe(nn.Conv2d(4, 40, 4, stride=4), 40 * 2 * 2), _floats(BATCH, 4, 8, 8)),
    "embedding": (lambda: Probe(nn.Embedding(11, 4), 5 * 4), _tokens(BATCH, 5)),
    "embedding_chunked": (lambda: Probe(nn.Embedding(11, 4), 700 * 4), _tokens(BATCH, 700)),  # bk: 2 examples a chunk
    "embedding_reused": (lambda: Probe(TwoEmbeddings(), 3 * 4), _tokens(BATCH, 6)),
    "layernorm_sequence": (lambda: Probe(nn.LayerNorm(5), 4 * 5), _floats(BATCH, 4, 5)),
    "layernorm_reused": (lambda: Probe(nn.LayerNorm(5), 4 * 5, reuse=True), _floats(BATCH, 4, 5)),
    "groupnorm": (lambda: Probe(nn.GroupNorm(2, 4), 4 * 3 * 3), _floats(BATCH, 4, 3, 3)),
    "groupnorm_reused": (lambda: Probe(nn.GroupNorm(2, 4), 4 * 3 * 3, reuse=True), _floats(BATCH, 4, 3, 3)),
}
MUST_ACCEPT = ("hooks", "auto")


def _build(case):
    torch.manual_seed(0)
    factory, x = CASES[case]
    model = factory()
    if isinstance(model.body, (nn.LayerNorm, nn.GroupNorm)):  # affine parameters start at 1 and 0: move them
        with torch.no_grad():
            for p in model.body.parameters():
                p.add_(0.3 * torch.randn_like(p))
    y = torch.randint(0, CLASSES, (len(x),), generator=torch.Generator().manual_seed(5))
    return model, x, y


def _params():
    for case in CASES:
        for mode in GRAD_SAMPLE_MODES:
            yield pytest.param(case, mode, id=f"{case}-{mode}")


@pytest.mark.parametrize("case, mode", _params())
def test_clipped_sum_equals_the_per_example_loop(case, mode):
    model, x, y = _build(case)
    expected, clipped = clipped_sum(model, rows(x, y), CLIP)
    assert 0 < clipped  # the clip binds: a mode that skipped clipping would not match

    model, x, y = _build(case)
    try:
        step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=CLIP,
                            noise_multiplier=0.0, grad_sample_mode=mode, max_physical_batch_size=PHYSICAL)
        step.check((x, y))
    except WorkbenchError as refusal:
        if mode in MUST_ACCEPT and not (mode == "hooks" and case.startswith("hf_")):  # Opacus has no Conv1D rule
            raise
        # A mode may refuse a layer, but only before training and in one line naming the mode: never a wrong gradient.
        assert "\n" not in str(refusal) and str(refusal), refusal
        return
    _, count = step((x, y), step=0)
    assert count == len(y)
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-4, atol=1e-6)


def test_the_linear_gram_route_is_taken_where_it_costs_fewer_flops():
    """bk's Linear sequences choose by cost (LinearRule's docstring): kept with Gram norms where the float32 Gram
    matrices cost less than forming would add (the MiniLM preset's 384x1536 FFN at T = 128: measured 16 ms against
    58 ms formed, 33 ms for the weight-gradient matmul both pay), formed during the backward where memory allows
    (at most FORM_IF = 1.25x a and g) and the Gram matrices cost more (the same FFN at T = 256, T = 512; q/k/v at
    T = 256), kept by memory otherwise (q/k/v at T = 128, 1.5x; gpt's FFN, 1.6x). The
    Gram norms bound those of the per-sample gradients formed independently (float64 einsum) from above, tightly."""
    from workbench.privacy.clipping.layers import LinearRule

    rule = LinearRule()
    for t, d_in, d_out, kept, gram in ((128, 384, 1536, True, True), (128, 1536, 384, True, True),
                                       (256, 384, 1536, False, True), (512, 384, 1536, False, False),
                                       (128, 384, 384, True, True), (256, 384, 384, False, False),
                                       (128, 768, 3072, True, True), (5, 32, 96, True, True), (32, 64, 256, True, True),
                                       (32, 64, 64, False, True), (64, 64, 64, False, False)):
        m = nn.Linear(d_in, d_out, device="meta")  # shapes only
        a, g = torch.zeros(1, t, d_in, device="meta"), torch.zeros(1, t, d_out, device="meta")
        assert rule.keeps(m, a, g) is kept and rule.use_gram(a, g) is gram, (t, d_in, d_out)
    a, g = _floats(BATCH, 5, 32), _floats(BATCH, 5, 96).flip(0)
    per_sample = torch.einsum("nto,nti->noi", g.double(), a.double()).square().sum((1, 2))
    n2, in64, _, _ = rule._gram(a, g)
    assert in64 is None and bool((n2 >= per_sample).all())
    torch.testing.assert_close(n2, per_sample, rtol=1e-4, atol=0)


def test_the_float32_gram_bound_holds_and_falls_back_to_float64_where_it_is_loose():
    """The float32 Gram route's n2 is an upper bound on each example's exact squared norm (bound.gram32_margin), for
    plain inputs (half of whose float32 Gram sums round below the exact) and crafted ones: positions whose dot
    products cancel (a_2 = -a_1 + small: the float32 Gram loses the small part), one huge coordinate, subnormal
    values. Where the margin is loose beside the sum, that example alone is recomputed in float64 (exact Gram
    matrices: within gamma64 of the exact, its margin then the caller's err)."""
    from workbench.privacy.clipping.bound import U64, gamma
    from workbench.privacy.clipping.layers import LinearRule

    gen = torch.Generator().manual_seed(5)
    t, d_in, d_out = 6, 48, 40
    a, g = torch.randn(12, t, d_in, generator=gen), torch.randn(12, t, d_out, generator=gen)
    a[8, 1] = -a[8, 0] + 2.0 ** -12 * torch.randn(d_in, generator=gen)  # cancels in <a_0, a_1>
    g[8, 1], a[8, 2:] = g[8, 0], 0.0
    a[9, 2, 3] = 2.0 ** 40  # one huge coordinate
    a[10] *= 2.0 ** -70  # products below float32's normal range
    g[10] *= 2.0 ** -70
    a[11, 1], g[11, 1] = -a[11, 0], g[11, 0]  # a gradient of positions 2.. only, small beside what cancels
    a[11, 2:] *= 1e-4
    a[11] *= 1e15
    exact = torch.einsum("nto,nti->noi", g.double(), a.double()).square().sum((1, 2))
    n2, in64, an, gn = LinearRule._gram(a, g)
    assert bool((an >= a.double().norm(dim=2)).all()) and bool((gn >= g.double().norm(dim=2)).all())
    assert in64 is not None and bool(in64[8]) and bool(in64[11]) and not bool(in64[:8].any())
    assert bool((n2[~in64] >= exact[~in64]).all()), (n2 - exact)
    torch.testing.assert_close(n2[:8], exact[:8], rtol=2.0 ** -8, atol=0)  # tight where accepted
    # recomputed in float64: within sqrt(gamma64_D) S of the exact norm (the margin bound() puts in err)
    s = torch.linalg.vecdot(an, gn)[in64]
    margin = math.sqrt(gamma(d_in + d_out + t * t + 2, U64)) * s
    assert bool(((n2[in64].sqrt() - exact[in64].sqrt()).abs() <= margin).all())


def test_the_float64_gram_route_of_small_matrices_bounds_weight_and_bias_together():
    """Small Gram matrices (T^2 (d_in + d_out) <= LinearRule.GRAM64_IF: vit's layers) are taken in float64 with the
    bias folded in (a'_t = [a_t, 1]): the norm of [W, b]'s per-sample gradient, formed independently in float64, is
    within sqrt(gamma64_D) S of sqrt(n2) (that margin is in err, with the kernel's), on plain inputs and crafted ones
    (positions that cancel, one huge coordinate, subnormal values); without a bias, the weight's alone."""
    from workbench.privacy.clipping.bound import U64, gamma
    from workbench.privacy.clipping.layers import KERNEL_ROWS, LinearRule, kernel_depth

    gen = torch.Generator().manual_seed(6)
    t, d_in, d_out = 5, 32, 96
    assert t * t * (d_in + d_out) <= LinearRule.GRAM64_IF
    a, g = torch.randn(12, t, d_in, generator=gen), torch.randn(12, t, d_out, generator=gen)
    a[8, 1] = -a[8, 0] + 2.0 ** -12 * torch.randn(d_in, generator=gen)
    g[8, 1] = g[8, 0]
    a[9, 2, 3] = 2.0 ** 40
    a[10] *= 2.0 ** -70
    g[10] *= 2.0 ** -70
    for bias in (True, False):
        m = nn.Linear(d_in, d_out, bias=bias)
        b = LinearRule().bound(m, (a, g), len(a), 64)
        weight = torch.einsum("nto,nti->noi", g.double(), a.double()).square().sum((1, 2))
        exact = (weight + (g.double().sum(1).square().sum(1) if bias else 0)).sqrt()
        assert b.n2.dtype == torch.float64 and b.rel == 0.0 and b.floor == 0.0
        s = (a.double().square().sum(2) + bias).sqrt().mul(g.double().norm(dim=2)).sum(1)  # S with a' = [a, 1]
        d = d_in + bias + d_out + t * t + 2
        # err holds its own margin and the float32 kernel's worst case (gamma_K S: the clipped sum's matmul)
        assert bool((b.err >= s * (math.sqrt(gamma(d, U64)) + gamma(kernel_depth(64, t)))).all())
        assert bool(((b.n2.sqrt() - exact).abs() <= s * math.sqrt(gamma(d, U64))).all()), (b.n2.sqrt() - exact)
        assert bool((b.err <= s * (gamma(64 * t + 2 + math.ceil(64 / (KERNEL_ROWS // t))) + 2e-7)).all())  # tight
    # an entry past 2^64 (a squared norm float32 could not hold): that example takes the float64 route (n2 = inf)
    for side in (a, g):
        huge = side.clone()
        huge[3, 1, 2] = 2.0 ** 65
        n2 = LinearRule().bound(nn.Linear(d_in, d_out), (huge, g) if side is a else (a, huge), len(a), 64).n2
        assert math.isinf(n2[3]) and bool(n2[[0, 1, 2, 4]].isfinite().all())


def test_the_float64_gram_route_counts_the_float32_kernels_rounding():
    """An example whose positions cancel exactly (integer inputs near 2^25 summing to 0 over T, one g for all): its
    exact gradient is 0, so its float64 Gram norm is ~0, but the float32 kernel's rounded products do not cancel
    (~2 per entry). The bound's err (<= 1e-6 of it is the Gram's own float64 margin, the rest the kernel's gamma_K S)
    sends it to the float64 route; a bound without err would release that rounding, over a hundred times C."""
    from workbench.privacy.clipping.bound import RHO, clip_factors
    from workbench.privacy.clipping.layers import LinearRule

    gen = torch.Generator().manual_seed(7)
    n, t, d_in, d_out = 4, 5, 32, 96
    a = torch.randint(-2 ** 22, 2 ** 22, (n, t, d_in), generator=gen).double() * 8
    a[:, -1] = -a[:, :-1].sum(1)  # multiples of 8 below 2^27: exact in float32, and so is their sum, 0
    a = a.float()
    g = torch.randn(n, 1, d_out, generator=gen).expand(n, t, d_out).contiguous()
    m = nn.Linear(d_in, d_out, bias=False)
    rule = LinearRule()
    factor, rows = clip_factors([rule.bound(m, (a, g), n, 64)], n, CLIP, torch.float32, "cpu")
    out = torch.zeros_like(m.weight)
    rule.add_clipped(m, (a, g), factor, {id(m.weight): out})
    assert float(torch.einsum("nto,nti->oi", g, a).norm()) > 100 * CLIP  # what float32 releases unclipped
    assert rows is not None and bool(rows.all()) and float(out.norm()) <= CLIP * (1 + RHO)


class SelfAttention(nn.Module):
    """Self-attention whose q, k and v projections read one tensor (book-keeping joins them: JoinedLinears);
    out_proj reads another tensor of the same shape, which must not join them."""

    def __init__(self, t: int):
        super().__init__()
        from workbench.models.attention import PerExampleMultiheadAttention

        self.t, self.embed = t, nn.Linear(3, 16)
        self.attn, self.head = PerExampleMultiheadAttention(16, 2, batch_first=True), nn.Linear(16, CLASSES)

    def forward(self, x):
        h = self.embed(x.view(len(x), self.t, 3))
        return self.head(self.attn(h, h, h, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("t,gram", [(2, True), (4, False)])  # the joined layers' Gram route, their formed norms
def test_q_k_v_reading_one_input_are_joined_and_each_example_is_clipped_as_the_oracle_clips_it(t, gram, monkeypatch):
    from workbench.privacy.clipping.layers import LinearRule

    if not gram:  # kept by memory, norms formed (the route the Gram's cost rule leaves to layers called many times)
        monkeypatch.setattr(LinearRule, "GRAM_COST", math.inf)

    def make():
        torch.manual_seed(0)
        return SelfAttention(t)

    x, y = _floats(BATCH, t * 3) * 4, torch.arange(BATCH) % CLASSES
    expected, clipped = clipped_sum(make(), rows(x, y), CLIP)
    assert clipped >= 3  # the clip bites
    model = make()
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=CLIP,
                        noise_multiplier=0.0, grad_sample_mode="bk", max_physical_batch_size=PHYSICAL)
    step.check((x, y))
    step((x, y), step=0)
    a = model.attn
    assert list(step.clipper._joins) == [(a.q_proj, a.k_proj, a.v_proj)]  # out_proj's input differs: not joined
    assert LinearRule().use_gram(torch.zeros(1, t, 16), torch.zeros(1, t, 48)) is gram
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-4, atol=1e-6)


def test_the_small_cnn_trains_privately(make_cfg, mlflow_uri):
    """model=cnn on digits end to end (Conv2d + GroupNorm + Linear, through the mode auto picks): it learns (0.89-0.92
    measured over three secrets; chance is 0.1, one step gives 0.14), and its epsilon is dp_accounting's for the
    logged (q, sigma, steps)."""
    import dp_accounting
    from mlflow import MlflowClient

    from workbench import train
    from workbench.privacy import DEFAULT_PLD_DISCRETIZATION

    steps = 20
    result = train(make_cfg("model=cnn", f"max_steps={steps}", "per_device_train_batch_size=128",
                            "privacy.secure_seed=0"))  # pinned: the same batches and noise every time
    assert result.steps == steps and result.metrics["eval_accuracy"] > 0.8
    m = MlflowClient(tracking_uri=mlflow_uri).get_run(result.run_id).data.metrics
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=DEFAULT_PLD_DISCRETIZATION)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(m["sample_rate"], dp_accounting.GaussianDpEvent(m["noise_multiplier"])), steps))
    assert m["epsilon"] == pytest.approx(acc.get_epsilon(m["delta"]), rel=1e-6) and m["epsilon"] <= 8.0


def test_patch_convolutions_take_the_patch_rule_and_form_what_the_convolution_kernel_forms():
    """bk reads a convolution with kernel == stride, no padding, dilation 1 and one group as a Linear on its patches
    (PatchConvRule), any other as a convolution (ConvRule); the per-sample gradients it forms from the reshaped input
    are those of the layer's own weight-gradient kernel (ConvRule's, examples folded into groups), and in float64 those
    of an independent unfold + einsum."""
    from workbench.privacy.clipping.layers import ConvRule, PatchConvRule, rule_for

    for m in (nn.Conv2d(1, 3, 3, stride=2), nn.Conv2d(1, 3, 2, stride=2, padding=1), nn.Conv2d(2, 4, 2, stride=2, groups=2),
              nn.Conv2d(1, 2, 2, stride=2, dilation=2), nn.Conv2d(1, 3, 1, padding="same"), nn.Conv1d(1, 2, 3)):
        assert type(rule_for(m)[0]) is ConvRule, m
    cases = ((nn.Conv2d(3, 8, 4, stride=4), (5, 3, 9, 10)), (nn.Conv1d(2, 5, 3, stride=3), (4, 2, 11)),
             (nn.Conv2d(1, 6, 4, stride=4, padding="valid"), (6, 1, 8, 8)), (nn.Conv2d(2, 3, (2, 3), stride=(2, 3)),
                                                                              (3, 2, 6, 7)))
    for m, shape in cases:
        rule = rule_for(m)[0]
        assert isinstance(rule, PatchConvRule), m
        a = _floats(*shape)
        g = torch.randn_like(m(a)).flip(0)
        got, ref = rule.per_sample(m, a, g), ConvRule().per_sample(m, a, g)
        assert set(got) == {"weight", "bias"}
        for name in got:
            torch.testing.assert_close(got[name], ref[name])
        two_d = a.dim() == 4
        u = torch.nn.functional.unfold((a if two_d else a.unsqueeze(2)).double(),
                                       m.kernel_size if two_d else (1, *m.kernel_size),
                                       stride=m.stride if two_d else (1, *m.stride))
        exact = torch.einsum("nol,npl->nop", g.double().flatten(2), u).reshape(got["weight"].shape)
        torch.testing.assert_close(got["weight"].double(), exact, rtol=1e-5, atol=1e-5)


def test_layernorm_reads_the_forwards_own_statistics_and_forms_what_recomputing_forms():
    """bk's taps hand LayerNorm's rule the mean and 1/std autograd saved in the forward (no second layer_norm during
    the backward); the per-sample gradients from them are those recomputed from the input. Half-precision inputs
    (autocast) and RMSNorm recompute."""
    from workbench.privacy.clipping.layers import LayerNormRule

    rule, ln = LayerNormRule(), nn.LayerNorm(6)
    with torch.no_grad():
        ln.weight.add_(0.3 * torch.randn(6))
    a = _floats(BATCH, 4, 6).requires_grad_()
    out = ln(a)
    saved = rule.saved(ln, a.detach(), out)
    assert saved is not None and saved[0].shape == (BATCH, 4, 1)
    g = torch.randn_like(out)
    got, ref = rule.per_sample(ln, a.detach(), g, saved=saved), rule.per_sample(ln, a.detach(), g)
    for name in ("weight", "bias"):
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-6)
    assert rule.saved(ln, a.detach().flip(0), out) is None  # statistics of another tensor: never used
    half = a.detach().bfloat16().requires_grad_()
    assert rule.saved(ln.bfloat16(), half.detach(), ln.bfloat16()(half)) is None
    rms = nn.RMSNorm(6)
    assert rule.saved(rms, a.detach(), rms(a)) is None

