"""What every clipping strategy shares: the loss callable it is given and the interface it offers.

A strategy is made once per run for one model and offers
  ``module``                        the module to call in forward passes (the model, or Opacus' wrapper of it);
  ``check(batch, loss_fn)``         before training, on a real batch: refuse what it would clip wrong;
  ``accumulate(batch, loss_fn, view_of) -> losses``
                                    add the micro-batch's sum of per-sample gradients, each clipped to C (or plain
                                    gradients for the non-private twin), into ``view_of`` (parameter id -> a view of
                                    the step's flat buffer); return the per-example losses, detached.
``loss_fn(module, batch)`` runs the forward and returns one loss per example: the strategy decides which module is called
and what autograd does with the losses; the trainer decides what a batch is.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from workbench.errors import WorkbenchError

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class Strategy:
    """Base of the strategies: ``check`` by default only runs the loss once (one loss per example?), without grad."""

    module: nn.Module
    max_batch = 1  # the most examples one accumulate() may get (GradientStep sets max_physical_batch_size): public,
    # so that the floating-point margins (clipping/bound.py) never depend on how many examples were drawn
    # Adaptive clipping (clipping/adaptive.py): a 0-d slot of the step's buffer that every accumulate() adds
    # 1[example not scaled down] - 1/2 to, per example; None (fixed C): nothing is counted.
    unclipped: torch.Tensor | None = None

    def count(self, factor: torch.Tensor, exact: list[float] = ()) -> None:
        """Add the micro-batch's shifted count of examples not scaled down: ``factor`` the batch path's clip factors
        (1: the certified bound is within C; the float64 route's rows are 0 there), ``exact`` the float64 route's
        factors (:func:`~workbench.privacy.clipping.bound.add_exact`). Each term depends on its example alone."""
        if self.unclipped is None:
            return
        within = (factor >= 1.0).sum() + sum(f >= 1.0 for f in exact)
        self.unclipped.add_(within - 0.5 * len(factor))

    def check(self, batch: Any, loss_fn: LossFn) -> None:
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                loss_fn(self.module, batch)
        finally:
            self.module.train(was_training)

    def accumulate(self, batch: Any, loss_fn: LossFn, view_of: dict[int, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


def require_own(k: int, name: str, mode: str, got: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor,
                tolerance: float, floor: float = 0.0) -> None:
    """The pre-run check's verdict on one parameter: example k's row ``got`` must equal autograd's gradient ``ref``
    of example k's loss alone, up to rounding. Rounding grows with the terms summed (``magnitude``: the same sum over
    |terms|), not with their possibly cancelling sum; in half precision small entries underflow, hence the floor at
    the parameter's largest term. ``floor``: rounding noise allowed everywhere (for a check that cannot see the terms).
    A gradient that is not finite is not compared: training zeroes that example's contribution
    (:func:`workbench.privacy.clipping.bound.clip_factors`)."""
    if not bool(torch.isfinite(ref).all()):
        return
    bound = tolerance * (ref.abs() + magnitude + float(magnitude.max()) * tolerance) + floor + 1e-12
    if not bool(((got - ref).abs() <= bound).all()):
        raise WorkbenchError(
            f"grad_sample_mode={mode}: example {k}'s gradient of {name!r} is not its own: the model mixes examples "
            "(across the batch, in a layer or the loss), feeds a layer time-major, or uses the weight outside its "
            "layer; per-sample clipping cannot apply")


def check_tolerance(dtype: torch.dtype) -> float:
    return max(1e-4, 16 * torch.finfo(dtype).eps)


def add_grads(params: list[nn.Parameter], view_of: dict[int, torch.Tensor]) -> None:
    """Move each parameter's .grad into its buffer view (None: unused in this forward, adds nothing)."""
    for p in params:
        if p.grad is not None:
            view_of[id(p)].add_(p.grad)
            p.grad = None
