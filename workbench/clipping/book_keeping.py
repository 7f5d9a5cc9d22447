"""Book-keeping per-sample clipping (Bu et al., 2023): one forward, one backward, no per-sample gradients kept.

The forward keeps each trainable layer's input a; one backward asks autograd for dL/dz at each layer output z only (no
weight gradients, no second pass). From (a, g = dL/dz) each layer's rule (:mod:`workbench.clipping.layers`: Linear,
Embedding, Conv1d/2d, LayerNorm/RMSNorm, GroupNorm; biases and frozen parameters included) gives the per-sample
squared norms; their sum over layers gives the clip factors f_i, and the rule adds sum_i f_i grad_i into the buffer.
A layer called more than once (or on a sequence (B, T, d)) is exact: its calls are summed per example before norms.

It relies on what every per-sample mode relies on -- a layer's input rows are examples, one loss per example -- and on
seeing every use of a weight. :meth:`BookKeeping.check` verifies this on a real batch before training.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from workbench.clipping.base import LossFn, Strategy, check_tolerance, clip_factors, require_own
from workbench.clipping.layers import rule_for
from workbench.errors import WorkbenchError


def trainable_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


def refusal(layers: list[nn.Module]) -> str | None:
    """Why book-keeping cannot clip these layers (None: it can)."""
    for m in layers:
        _, why = rule_for(m)
        if why:
            return why
    params = [p for m in layers for p in m.parameters(recurse=False)]
    if len({id(p) for p in params}) < len(params):  # a per-layer norm would split a shared weight's norm in two
        return "cannot clip a parameter shared between layers (tied weights)"
    return None


def _input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["input"]


class BookKeeping(Strategy):
    """grad_sample_mode=bk."""

    def __init__(self, model: nn.Module, clip: float):
        self.module, self.clip = model, clip
        self.layers = trainable_layers(model)
        why = refusal(self.layers)
        if why:
            raise WorkbenchError(f"grad_sample_mode=bk {why}: use grad_sample_mode=auto")
        self.rules = {m: rule_for(m)[0] for m in self.layers}
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.layer_names = {m: n for n, m in model.named_modules()}
        self.checked = False

    def _run(self, batch, loss_fn: LossFn):
        """Forward with the recording hooks; returns the per-example losses and, per layer call, its input and the
        autograd edge of its output (the edge, not the tensor: memory like a non-private step's)."""
        records: list[tuple[nn.Module, torch.Tensor, object]] = []

        def keep(m, args, kwargs, out):
            if not out.requires_grad:
                raise WorkbenchError("grad_sample_mode=bk: gradients are disabled in the model's forward (no_grad?)")
            records.append((m, _input(args, kwargs).detach(), get_gradient_edge(out)))

        handles = [m.register_forward_hook(keep, with_kwargs=True) for m in self.layers]
        try:
            losses = loss_fn(self.module, batch)
        finally:
            for h in handles:
                h.remove()
        if not records:
            raise WorkbenchError("grad_sample_mode=bk: no trainable layer ran in the model's forward")
        return losses, records

    def _by_layer(self, records: list, grads: tuple, n: int) -> dict[nn.Module, list]:
        """Per layer, its calls' (a, g), batch first."""
        layers: dict[nn.Module, list] = {}
        for (m, a, _), g in zip(records, grads):
            if g is None:  # this output did not reach the loss
                continue
            if a.shape[0] != n or g.shape[0] != n:
                raise WorkbenchError(f"grad_sample_mode=bk needs each layer's input to keep the batch as dim 0: "
                                     f"layer {self.layer_names[m]!r} ({type(m).__name__}) got {tuple(a.shape)} for a "
                                     f"batch of {n} (flattened or time-major?); reshape it to (batch, ..., features)")
            layers.setdefault(m, []).append((a, g))
        return layers

    def _gradients(self, batch, loss_fn: LossFn, retain: bool):
        losses, records = self._run(batch, loss_fn)
        grads = torch.autograd.grad(losses.sum(), [edge for _, _, edge in records], retain_graph=retain,
                                    allow_unused=True)
        return losses, self._by_layer(records, grads, len(losses))

    def check(self, batch, loss_fn: LossFn) -> None:
        """On a real batch, in the model's training mode: each example's row of bk must be that example's own gradient
        (autograd's gradient of its loss alone). Time-major inputs, layers or losses that mix examples, and weights
        used outside their layer all fail it; mixing that appears only in larger batches cannot be seen."""
        was_training = self.module.training
        self.module.train()  # the mode it trains in, whatever mode it was handed over in
        try:
            losses, layers = self._gradients(batch, loss_fn, retain=True)
        finally:
            self.module.train(was_training)
        n = len(losses)
        if n < 2:  # one example cannot show mixing; accumulate checks the first larger batch
            return
        params = [p for m in self.layers for p in m.parameters(recurse=False) if p.requires_grad]
        tolerance = check_tolerance(params[0].dtype)
        exact = torch.promote_types(params[0].dtype, torch.float32)
        for k in range(n):
            mine: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # parameter id -> (row k's gradient, its |terms|)
            for m, calls in layers.items():
                calls = [(a.to(exact) if a.is_floating_point() else a, g.to(exact)) for a, g in calls]
                rule = self.rules[m]
                got, magnitude = rule.sample(m, calls, k), rule.sample(m, calls, k, absolute=True)
                for name in got:
                    mine[id(getattr(m, name))] = (got[name], magnitude[name])
            own = torch.autograd.grad(losses[k], params, retain_graph=True, allow_unused=True)
            for p, ref in zip(params, own):
                ref = torch.zeros(p.shape, device=p.device, dtype=exact) if ref is None else ref.to(exact)
                if ref.is_sparse:  # nn.Embedding(sparse=True)
                    ref = ref.to_dense()
                got, magnitude = mine.get(id(p), (torch.zeros_like(ref), torch.zeros_like(ref)))
                require_own(k, self.names[id(p)], "bk", got, ref, magnitude, tolerance)
        self.checked = True

    def accumulate(self, batch, loss_fn: LossFn, view_of: dict[int, torch.Tensor]) -> torch.Tensor:
        """Add the micro-batch's clipped gradient sum into ``view_of`` (parameter id -> gradient buffer view)."""
        if not self.checked:  # GradientStep.check normally did this before training
            self.check(batch, loss_fn)
        losses, layers = self._gradients(batch, loss_fn, retain=False)
        n = len(losses)
        dtype = torch.promote_types(next(iter(view_of.values())).dtype, torch.float32)
        norms2 = torch.zeros(n, device=losses.device, dtype=dtype)
        states = {m: self.rules[m].prepare(m, calls, n) for m, calls in layers.items()}
        for m, state in states.items():
            norms2.add_(self.rules[m].norms2(m, state, n))
        factor = clip_factors(norms2.sqrt_(), self.clip)
        for m, state in states.items():
            self.rules[m].add_clipped(m, state, factor, view_of)
        return losses.detach()
