"""Book-keeping's lean path for Linear layers on float32 rows (workbench/privacy/clipping/rows.py) against the generic
path: on crafted inputs (NaN, inf, huge, tiny, subnormal, cancelling, a frozen bias, a layer without bias), the same
factors and the same clipped sums bit for bit, the generic path taken wherever the lean one steps aside, and every
example's contribution as added within C (1 + RHO) and equal to the float64 oracle's where the inputs are tame."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.oracle import clipped_sum
from workbench.privacy.clipping.book_keeping import BookKeeping
from workbench.privacy.clipping.bound import RHO
from workbench.privacy.clipping.rows import LinearRows

CLIP = 0.7


def _mlp(bias_last: bool = True, freeze_first_bias: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4, bias=bias_last), nn.ReLU(), nn.Linear(4, 3))
    if freeze_first_bias:
        model[0].bias.requires_grad_(False)
    return model


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y, reduction="none")


def _run(model, x, y, lean: bool, max_batch: int = 16):
    """(released flat sum (float64), factors) of one accumulate, the lean path on or off; which path added it."""
    bk = BookKeeping(model, CLIP)
    bk.max_batch = max_batch
    assert isinstance(bk.lean, LinearRows)
    taken, add = [], bk.lean.add

    def spy(*args):
        out = add(*args)
        taken.append(out is not None)
        return out

    bk.lean.add = spy
    if not lean:
        bk.lean = None
    factors = []
    bk.count = lambda factor, exact=(): factors.append(factor.clone())
    params = [p for p in model.parameters() if p.requires_grad]
    view_of = {id(p): torch.zeros_like(p) for p in params}
    bk.accumulate((x, y), _loss, view_of)
    flat = torch.cat([view_of[id(p)].flatten() for p in params]).double()
    return flat, factors[0], bool(taken and taken[0])


def _crafted(kind: str) -> torch.Tensor:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    if kind == "nan":
        x[2, 3] = math.nan
    elif kind == "inf":
        x[5, 0] = math.inf
    elif kind == "huge":  # squares past float32's range: the float64 route
        x[1] *= 3e37
    elif kind == "large":  # large but with finite float32 squares
        x[4] *= 1e15
    elif kind == "tiny":  # squares below float32's normal range
        x[3] *= 1e-39
    elif kind == "zero":
        x[6] = 0.0
    elif kind == "cancel":  # one example the sum of two others' negatives
        x[7] = -(x[0] + x[1])
    return x


KINDS = ["plain", "nan", "inf", "huge", "large", "tiny", "zero", "cancel"]


@pytest.mark.parametrize("variant", ["bias", "no_last_bias", "frozen_bias"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_lean_path_is_the_generic_path_bit_for_bit_and_steps_aside_where_it_must(kind, variant):
    x, y = _crafted(kind), torch.arange(8) % 3
    make = lambda: _mlp(bias_last=variant != "no_last_bias", freeze_first_bias=variant == "frozen_bias")  # noqa: E731
    lean, f_lean, took = _run(make(), x, y, lean=True)
    generic, f_generic, _ = _run(make(), x, y, lean=False)
    assert torch.equal(f_lean, f_generic)
    assert torch.equal(lean, generic)  # NaN-free: a non-finite example contributes 0 on both
    assert bool(lean.isfinite().all())
    # the lean path adds only where every example's bound is finite and its factor scales exactly in float32
    assert took == (kind not in ("nan", "inf", "huge"))


@pytest.mark.parametrize("kind", KINDS)
def test_each_examples_contribution_on_the_lean_path_is_within_the_clip(kind):
    """Each example released alone (its factor uses the public max_batch, not the 1 drawn: the same as in the batch):
    its contribution is the buffer itself, within C (1 + RHO); where the inputs are tame, the float64 oracle's."""
    x, y = _crafted(kind), torch.arange(8) % 3
    model = _mlp()
    for k in range(len(x)):
        released, _, _ = _run(model, x[k:k + 1], y[k:k + 1], lean=True)
        assert float(released.norm()) <= CLIP * (1 + RHO)
        if bool(x[k].isfinite().all()) and float(x[k].abs().max()) < 1e6 and float(x[k].abs().max()) > 1e-30:
            oracle = torch.cat([g.flatten() for g in clipped_sum(model, [(x[k:k + 1], y[k:k + 1])], CLIP).grads])
            torch.testing.assert_close(released, oracle.double(), rtol=1e-5, atol=1e-7)


def test_the_lean_path_serves_only_linear_layers_on_float32_rows():
    """Public conditions only: a layer called twice, a sequence, another dtype or another layer kind -> generic."""
    x, y = torch.randn(4, 6), torch.arange(4) % 3

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.b(self.a(torch.tanh(self.a(x))))

    _, _, took = _run(Twice(), x, y, lean=True)
    assert not took

    class Sequence(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x.view(len(x), 2, 3)).mean(1)

    _, _, took = _run(Sequence(), x, y, lean=True)
    assert not took
    assert BookKeeping(nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4)), CLIP).lean is None
    double = _mlp().double()
    _, _, took = _run(double, x.double(), y, lean=True)
    assert not took


def test_the_lean_paths_margins_follow_the_batch_bound_and_the_clip():
    """The constants are remade when the public batch bound or C changes (adaptive clipping moves C every step)."""
    x, y = _crafted("plain"), torch.arange(8) % 3
    model = _mlp()
    bk = BookKeeping(model, CLIP)
    view_of = {id(p): torch.zeros_like(p) for p in model.parameters()}
    for max_batch, clip in [(16, CLIP), (4096, CLIP), (16, 0.01), (16, CLIP)]:
        bk.max_batch, bk.clip = max_batch, clip
        got = []
        bk.count = lambda factor, exact=(): got.append(factor)
        bk.accumulate((x, y), _loss, view_of)
        ref = BookKeeping(model, clip)
        ref.max_batch, ref.lean = max_batch, None
        want = []
        ref.count = lambda factor, exact=(): want.append(factor)
        ref.accumulate((x, y), _loss, {id(p): torch.zeros_like(p) for p in model.parameters()})
        assert torch.equal(got[0], want[0])


def _lean_after_a_change(model: nn.Module, change, x: torch.Tensor, y: torch.Tensor) -> dict[int, torch.Tensor]:
    """One step on the lean path (its margins made), then ``change(model, x)`` (returns the next input), then one more
    step on the same BookKeeping: its factors and sums must be a fresh generic path's on the changed model. Returns the
    second step's sums (parameter id -> buffer view)."""
    bk = BookKeeping(model, CLIP)
    bk.max_batch = 16
    bk.accumulate((x, y), _loss, {id(p): torch.zeros_like(p) for p in model.parameters()})
    x = change(model, x)
    sums, factors = {}, {}
    for name, lean in (("lean", bk), ("generic", BookKeeping(model, CLIP))):
        if name == "generic":
            lean.max_batch, lean.lean = 16, None
        lean.count = lambda factor, exact=(), name=name: factors.setdefault(name, factor)
        sums[name] = {id(p): torch.zeros_like(p) for p in model.parameters()}
        lean.accumulate((x, y), _loss, sums[name])
    assert torch.equal(factors["lean"], factors["generic"])
    for p in model.parameters():
        assert torch.equal(sums["lean"][id(p)], sums["generic"][id(p)])
    return sums["lean"]


def test_a_parameter_frozen_after_construction_leaves_the_lean_paths_sums_and_margins():
    """The lean path reads each layer's trainable parameters every step, as the generic path does: a bias frozen
    between two steps is neither summed nor in the margins from then on (the same factors and sums as the generic
    path's on the frozen model)."""
    model = _mlp()

    def freeze(model, x):
        model[0].bias.requires_grad_(False)
        return x

    sums = _lean_after_a_change(model, freeze, _crafted("plain"), torch.arange(8) % 3)
    assert not sums[id(model[0].bias)].any()


def test_a_weight_replaced_by_one_of_another_width_remakes_the_lean_paths_margins():
    """The margins follow the widths of a and g as they arrive (the generic path reads them there), not the layer's
    in_features: a weight swapped for a wider one between steps gives the generic path's factors and sums."""
    def widen(model, x):
        model[0].weight = nn.Parameter(torch.randn(5, 600, generator=torch.Generator().manual_seed(3)))
        return torch.randn(8, 600, generator=torch.Generator().manual_seed(4))

    _lean_after_a_change(_mlp(), widen, _crafted("plain"), torch.arange(8) % 3)
