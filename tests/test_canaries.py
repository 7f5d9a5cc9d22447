"""The canaries of the one-run audit (workbench/privacy/auditing/canaries.py) in the trainer's own step: the user's
parameters get exactly the unaudited clipped sum, each member canary C on its own coordinate, blanks 0."""

import pytest
import torch
from torch import nn

from tests.oracle import CLIPPED_RTOL
from workbench.privacy.auditing.canaries import CanaryAudit
from workbench.privacy.clipping.bound import RHO


def _set(n=12, seed=1):
    from workbench.data import ArrayDataset

    g = torch.Generator().manual_seed(seed)
    return ArrayDataset(torch.randn(n, 6, generator=g) * 3, torch.randint(0, 3, (n,), generator=g))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("mode", ["bk", "hooks", "functorch", "ew"])
def test_canaries_take_the_trainers_own_path_and_touch_only_their_coordinate(mode):
    from workbench.distributed import setup
    from workbench.step import GradientStep

    base, m, clip = _set(), 10, 0.5
    ordinary = list(range(len(base)))
    canaries = CanaryAudit(m, base, 0.05)
    members = canaries.dataset.draw_membership(secret=7, seed=0)
    assert 0 < members.sum() < m
    batch = canaries.dataset.__getitems__(ordinary + [len(base) + j for j in range(m)])
    module, criterion = canaries.wrap(_model(), nn.CrossEntropyLoss(reduction="none"), lambda: clip)
    step = GradientStep(module, criterion, setup("gloo"), max_grad_norm=clip, noise_multiplier=0.0, grad_sample_mode=mode)
    step.check(batch)
    _, count = step(batch, step=0)
    assert count == len(base) + m  # blanks count as examples: the batch size never reveals membership

    # The user's parameters get exactly the unaudited clipped sum of the ordinary examples.
    plain = GradientStep(_model(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=clip,
                         noise_multiplier=0.0, grad_sample_mode=mode)
    plain(base.__getitems__(ordinary), step=0)
    for p, q in zip(step.params[:-1], plain.params):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    # The block: C on each member canary's coordinate (its clipped norm, up to the floating-point bound's margin:
    # never above C (1 + RHO)), exactly 0 on blanks; the block is the last parameter.
    assert step.params[-1] is module.canaries.weight
    got = module.canaries.weight.grad.reshape(-1)
    members = torch.from_numpy(members)
    assert bool((got[~members] == 0).all())
    assert bool((got[members] <= clip * (1 + RHO)).all()) and bool((got[members] >= clip * (1 - CLIPPED_RTOL)).all())


def test_examples_must_be_tensor_pairs():
    from workbench.errors import WorkbenchError

    with pytest.raises(WorkbenchError, match=r"\(x, y\) examples"):
        CanaryAudit(10, [{"x": torch.zeros(2)}], 0.05)
    assert len(CanaryAudit(10, _set(), 0.05).dataset) == 12 + 10


def test_with_adaptive_clipping_each_canary_gradient_has_the_steps_own_c():
    """C_t moves between steps: a member canary's released coordinate is C_t (not the initial C), read at each step."""
    from workbench.distributed import setup
    from workbench.privacy.clipping.adaptive import AdaptiveClip
    from workbench.step import GradientStep

    base, m = _set(), 10
    canaries = CanaryAudit(m, base, 0.05)
    members = torch.from_numpy(canaries.dataset.draw_membership(secret=7, seed=0))
    batch = canaries.dataset.__getitems__([len(base) + j for j in range(m)])
    schedule = AdaptiveClip(0.5, count_noise=10.0, expected_batch=m)
    module, criterion = canaries.wrap(_model(), nn.CrossEntropyLoss(reduction="none"), lambda: schedule.value)
    step = GradientStep(module, criterion, setup("gloo"), max_grad_norm=0.5, noise_multiplier=0.0,
                        grad_sample_mode="bk", clip_schedule=schedule)
    step.count_noise.adds = False  # a noiseless count: C moves by the canaries' own clipped count alone
    for t in range(3):
        clip = schedule.value
        step(batch, step=t)
        got = module.canaries.weight.grad.reshape(-1)
        assert bool((got[members] <= clip * (1 + RHO)).all()) and bool((got[members] >= clip * (1 - CLIPPED_RTOL)).all())
        assert schedule.value != clip  # the schedule moved: the next step's canaries follow it
