"""Per-user clipping (``privacy.unit=user``, workbench/privacy/users.py): a user's combined gradient is clipped to C
as one unit.

The combined gradient is the **mean** of the user's (at most k) examples' gradients, i.e. the gradient of the user's
mean loss. Either the mean or the sum gives sensitivity C per user once clipped; the mean keeps a user's gradient on
the scale of one example's, so a C tuned for example-level DP-SGD still fits, and a user with many examples is not
clipped harder merely for having them.

Route: a materialising strategy (hooks, functorch, ew or vmap: per-example gradients in ``p.grad_sample``) computes
every example's gradient; rows are averaged per user into one (users, P) tensor per parameter; that tensor is then
clipped and summed exactly as the materialised modes clip per-example rows
(:class:`~workbench.privacy.clipping.opacus_modes.PerSampleGradients`): norms, factors and the sum from the very
tensor summed, so the floating-point bound of clipping/bound.py holds per user (each user's contribution as summed
<= C (1 + RHO); a user whose bound is not finite or whose factor is tiny is recomputed alone in float64). Rounding in
forming the mean is inside the clipped tensor, so it cannot escape the clip. book-keeping (``bk``) never forms
per-example gradients and is not used here. A user's examples must be in one micro-batch (workbench/user_step.py).

Adaptive clipping (clipping/adaptive.py) counts users: user u adds 1[its factor is 1] - 1/2 to the step's count
slot, one term per user (sensitivity 1/2 under adding or removing a user, whatever its examples), and the
schedule's B is the expected batch of users (the plan's shard is over users).
"""

from __future__ import annotations

import torch

from workbench.errors import WorkbenchError
from workbench.privacy.clipping.base import LossFn, Strategy
from workbench.privacy.clipping.bound import add_exact, clip_factors, exact_float32, materialised, zero_rows

BK_REFUSAL = ("privacy.unit=user needs per-example gradients to combine per user: grad_sample_mode=bk never forms "
              "them; use auto, hooks, functorch, ew or vmap")


class PerUser(Strategy):
    """Wraps a materialising strategy; ``accumulate`` reads the micro-batch's ``user_sizes`` (examples per user, in
    order, summing to the micro-batch's length)."""

    def __init__(self, inner: Strategy, clip: float):
        if not hasattr(inner, "_backward"):
            raise WorkbenchError(BK_REFUSAL)
        self.inner, self.clip, self.mode = inner, clip, inner.mode
        self.params = inner.params

    @property
    def module(self):
        return self.inner.module

    @property
    def checked(self) -> bool:
        return getattr(self.inner, "checked", True)

    def check(self, batch, loss_fn: LossFn) -> None:
        self.inner.check(batch, loss_fn)  # each example's row is its own gradient: then so is each user's mean

    def accumulate(self, batch, loss_fn: LossFn, view_of: dict[int, torch.Tensor]) -> torch.Tensor:
        sizes = getattr(batch, "user_sizes", None)
        if sizes is None or sum(sizes) != len(batch):
            raise WorkbenchError("per-user clipping needs the micro-batch's user sizes (workbench/user_step.py)")
        losses = self.inner._backward(batch, loss_fn, checking=False)
        n, users, device = len(losses), len(sizes), losses.device
        segment = torch.repeat_interleave(torch.arange(users, device=device), torch.as_tensor(sizes, device=device))
        per_user = []
        for p in self.params:
            if p.grad_sample is None:  # unused in this forward: its clipped gradient is zero
                continue
            view = view_of[id(p)]
            rows = p.grad_sample.reshape(n, -1).to(torch.promote_types(view.dtype, torch.float32))
            mean = torch.zeros(users, rows.shape[1], device=device, dtype=rows.dtype).index_add_(0, segment, rows)
            mean.div_(torch.as_tensor(sizes, device=device, dtype=rows.dtype).unsqueeze(1))
            per_user.append((view, mean, rows))
        batch_bound = max(users, self.max_batch)
        with exact_float32(device):  # the float32 kernels the bound assumes
            factor, bad = clip_factors([materialised(m, batch_bound) for _, m, _ in per_user], users, self.clip,
                                       next(iter(view_of.values())).dtype, device)
            for view, m, _ in per_user:
                m = m if bad is None else zero_rows(m, bad)
                view.view(-1).add_(torch.mv(m.t(), factor.to(m.dtype)))
        exact = []  # those users alone, their mean formed again in float64 (a float32 sum may overflow)
        for k in ([] if bad is None else bad.nonzero().flatten().tolist()):
            own = segment == k
            exact.append(add_exact({id(view): r[own].double().mean(0).view_as(view) for view, _, r in per_user},
                                   self.clip, {id(view): view for view, _, _ in per_user}))
        self.count(factor, exact)  # adaptive clipping: one term per user, never per example
        for p in self.params:
            p.grad_sample = None
            p.grad = None
        return losses.detach()
