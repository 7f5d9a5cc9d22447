"""Opacus' per-sample gradient modes ``hooks``, ``functorch`` and ``ew`` (torch's expanded weights): per-sample
gradients are materialised in ``p.grad_sample``; their flat norms give the clip factors and one ``addmv_`` per
parameter the clipped sum, from the very tensors summed (:mod:`workbench.privacy.clipping.bound`).

Opacus' ``ghost`` (fast gradient clipping) is refused (:data:`GHOST_REFUSAL`): its norms are float32 Gram sums with
negatives clamped to 0, its clipped sum a second backward over other numbers, so rounding escapes the clip (one example
measured at 100 C). ``bk`` is the one-backward mode without per-sample gradients whose bound is certified.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.privacy.clipping.base import LossFn, Strategy, check_tolerance, require_own
from workbench.privacy.clipping.bound import add_exact, clip_factors, exact_float32, materialised, zero_rows
from workbench.errors import WorkbenchError


GHOST_REFUSAL = ("grad_sample_mode=ghost is refused: Opacus' ghost norms are float32 Gram sums computed from other "
                 "numbers than its clipped sum, so rounding can release an example far above C; use bk (one backward, "
                 "no per-sample gradients, a certified bound) or auto")
EW_MIXED_PRECISION = ("grad_sample_mode=ew cannot run in mixed precision: its clipped sum is not computed from the "
                      "per-sample gradients its norms were; use bk or hooks")  # the step's refusal, and job.py's up front


class _Checked(Strategy):
    """The pre-run check for Opacus' modes: on a real batch, in training mode, each example's per-sample gradient must
    equal autograd's gradient of that example's loss alone, computed on the unwrapped model.
    Opacus sees a weight only through its layer's hooks: a weight also used outside its layer fails here."""

    params: list[nn.Parameter]
    mode: str
    checked = False  # GradientStep checks the first micro-batch itself when check() did not run before training

    @property
    def plain(self) -> nn.Module:
        """The user's model, without the mode's wrapper: the check's reference gradients come from it."""
        return self.module._module

    def _backward(self, batch, loss_fn: LossFn, checking: bool = True) -> torch.Tensor:
        """The forward and backward that leave each parameter's per-sample gradients in ``p.grad_sample``
        (``checking``: a failure of the mode is refused in one line; in training it is the step's error)."""
        try:
            losses = loss_fn(self.module, batch)
            losses.sum().backward()
        except RuntimeError as e:  # e.g. expanded weights meeting a weight used outside its layer, or an input
            # without a batch dimension (position ids shared by the batch)
            if not checking:
                raise
            raise WorkbenchError(f"grad_sample_mode={self.mode} cannot compute this model's per-sample "
                                 f"gradients: {str(e).splitlines()[0]}") from e
        return losses

    def _rows(self, n: int) -> dict[int, torch.Tensor]:
        """Per parameter id, what the mode computed per example after a backward of the summed losses."""
        raise NotImplementedError

    def check(self, batch, loss_fn: LossFn) -> None:
        seed = int(torch.randint(0, 2**62, (1,)))
        was_training = self.module.training
        self.module.train()
        hooks = getattr(self.module, "disable_hooks", None)
        try:
            with torch.random.fork_rng(devices=[]):  # the same dropout masks in both forwards
                torch.manual_seed(seed)
                if hooks:
                    self.module.disable_hooks()
                try:
                    losses = loss_fn(self.plain, batch)
                    own = [torch.autograd.grad(losses[k], self.params, retain_graph=True, allow_unused=True)
                           for k in range(len(losses))]
                finally:
                    if hooks:
                        self.module.enable_hooks()
                torch.manual_seed(seed)
                self._backward(batch, loss_fn)
            rows = self._rows(len(own))
        finally:
            self.module.train(was_training)
            for p in self.params:
                p.grad_sample = p.grad = None
        names = {id(p): n for n, p in self.plain.named_parameters()}
        for p in self.params:  # Opacus sums, without a word, over a batch its layer's input does not have
            if id(p) in rows and len(rows[id(p)]) != len(own):
                raise WorkbenchError(
                    f"grad_sample_mode={self.mode}: parameter {names[id(p)]!r} has no per-example gradient (rows for "
                    f"{len(rows[id(p)])} examples in a batch of {len(own)}: its layer's input does not keep the batch "
                    "as dim 0, e.g. position embeddings looked up with ids of shape (1, T)): freeze it, or feed it "
                    "per-example inputs")
        tolerance = check_tolerance(self.params[0].dtype)
        exact = torch.promote_types(self.params[0].dtype, torch.float32)
        for k, grads in enumerate(own):
            refs = []
            for p, ref in zip(self.params, grads):
                ref = torch.zeros(p.shape, device=p.device, dtype=exact) if ref is None else ref.to(exact)
                if ref.is_sparse:
                    ref = ref.to_dense()
                refs.append(ref)
            # Without the terms, a gradient that is zero in exact arithmetic (attention's key bias: softmax ignores a
            # shift shared by every key) is rounding noise at the scale of the example's whole gradient, not its own.
            floor = 16 * torch.finfo(self.params[0].dtype).eps * max(float(r.abs().max()) for r in refs)
            for p, ref in zip(self.params, refs):
                got = rows[id(p)][k].to(exact) if id(p) in rows else torch.zeros_like(ref)
                require_own(k, names[id(p)], self.mode, got, ref, ref.abs(), tolerance, floor)
        self.checked = len(own) > 1  # one example cannot show mixing: the first larger batch is checked too


class PerSampleGradients(_Checked):
    def __init__(self, model: nn.Module, params: list[nn.Parameter], clip: float, mode: str):
        from opacus.grad_sample import GradSampleModule, GradSampleModuleExpandedWeights

        self.params, self.clip, self.mode = params, clip, mode
        if mode == "ew":
            self.module = GradSampleModuleExpandedWeights(model, batch_first=True, loss_reduction="sum")
        else:
            self.module = GradSampleModule(model, batch_first=True, loss_reduction="sum",
                                           force_functorch=mode == "functorch")

    def _rows(self, n):
        return {id(p): p.grad_sample for p in self.params if p.grad_sample is not None}

    def accumulate(self, batch, loss_fn: LossFn, view_of: dict[int, torch.Tensor]) -> torch.Tensor:
        losses = self._backward(batch, loss_fn, checking=False)
        n = len(losses)
        # None: a parameter unused in this forward; its clipped gradient is zero. Norms, factors and the sum from
        # the very per-sample gradients summed (float32, whatever precision the backward ran in): clip what you sum.
        flat_samples = [(view_of[id(p)], p.grad_sample.reshape(n, -1).to(torch.promote_types(view_of[id(p)].dtype,
                                                                                          torch.float32)))
                        for p in self.params if p.grad_sample is not None]
        batch = max(n, self.max_batch)
        with exact_float32(losses.device):  # the matrix-vector products below must be the float32 ones the bound assumes
            factor, rows = clip_factors([materialised(gs, batch) for _, gs in flat_samples], n, self.clip,
                                        next(iter(view_of.values())).dtype, losses.device)
            for view, gs in flat_samples:  # rows: recomputed alone in float64 below (0 * inf is NaN in the sum)
                gs = gs if rows is None else zero_rows(gs, rows)
                view.view(-1).add_(torch.mv(gs.t(), factor.to(gs.dtype)))  # float32 at least, cast when added
        exact = [] if rows is None else [
            add_exact({id(view): gs[k].double().view_as(view) for view, gs in flat_samples}, self.clip,
                      {id(view): view for view, _ in flat_samples}) for k in rows.nonzero().flatten().tolist()]
        self.count(factor, exact)  # adaptive clipping only
        for p in self.params:
            p.grad_sample = None
            p.grad = None
        return losses.detach()
