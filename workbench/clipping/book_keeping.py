"""Book-keeping per-sample clipping (Bu et al., 2023) for models whose trainable layers are all ``nn.Linear``.

One forward keeps each Linear's input a; one backward asks autograd for dL/dz at each Linear output z only (no weight
gradients, no second pass). Per example i, a (B, d) input gives ||g_i a_i^T||^2 = ||a_i||^2 ||g_i||^2 in closed form;
a (B, T, d) input, or a layer called more than once, forms the per-sample gradient sum_t g_it a_it^T (exact and never
negative, unlike the Gram-matrix "ghost" norm in float32). The clipped sum sum_i f_i g_i a_i^T is one matmul per layer.

It relies on what every per-sample mode relies on -- a Linear's input rows are examples, one loss per example -- and on
seeing every use of a weight. :meth:`BookKeeping.check` verifies this on a real batch before training.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from workbench.clipping.base import LossFn, Strategy, clip_factors
from workbench.errors import WorkbenchError


def trainable_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


def refusal(layers: list[nn.Module]) -> str | None:
    """Why book-keeping cannot clip these layers (None: it can)."""
    for m in layers:
        if type(m).forward is not nn.Linear.forward:  # a subclass (LoRA, scaled weights...) may compute otherwise
            return f"handles models whose trainable layers are all plain nn.Linear, not {type(m).__name__}"
        if {n for n, _ in m.named_parameters(recurse=False)} - {"weight", "bias"} or m._forward_pre_hooks:
            return f"cannot see how {type(m).__name__}'s weight is computed (extra parameters or pre-hooks)"
    params = [p for m in layers for p in m.parameters(recurse=False)]
    if len({id(p) for p in params}) < len(params):  # a per-layer norm would split a shared weight's norm in two
        return "cannot clip a parameter shared between layers (tied weights)"
    return None


def _input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["input"]


def _as_sequence(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.reshape(n, -1, t.shape[-1])


class BookKeeping(Strategy):
    """grad_sample_mode=bk."""

    def __init__(self, model: nn.Module, clip: float):
        self.module, self.clip = model, clip
        self.layers = trainable_layers(model)
        why = refusal(self.layers)
        if why:
            raise WorkbenchError(f"grad_sample_mode=bk {why}: use grad_sample_mode=auto")
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.checked = False

    def _run(self, batch, loss_fn: LossFn):
        """Forward with the recording hooks; returns the per-example losses and, per layer that ran, its input and the
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
            raise WorkbenchError("grad_sample_mode=bk: no nn.Linear layer ran in the model's forward")
        return losses, records

    def _by_layer(self, records: list, grads: tuple, n: int) -> dict[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (a, g) as (B, features), or (B, T, features) for a sequence or a layer called more than once."""
        layers: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        for (m, a, _), g in zip(records, grads):
            if g is None:  # this output did not reach the loss
                continue
            if a.shape[0] != n:
                raise WorkbenchError(f"grad_sample_mode=bk needs each nn.Linear input to keep the batch as dim 0: "
                                     f"layer {self.names[id(m.weight)].removesuffix('.weight')!r} got "
                                     f"{tuple(a.shape)} for a batch of {n} (flattened or time-major?); reshape it "
                                     "to (batch, ..., features)")
            if m in layers:
                a, g = (torch.cat([_as_sequence(old, n), _as_sequence(new, n)], 1) for old, new in zip(layers[m], (a, g)))
            elif a.dim() > 2:
                a, g = _as_sequence(a, n), _as_sequence(g, n)
            layers[m] = (a, g)
        return layers

    def check(self, batch, loss_fn: LossFn) -> None:
        """On a real batch, in the model's training mode: each example's row of bk must be that example's own gradient
        (autograd's gradient of its loss alone). Time-major inputs, layers or losses that mix examples, and weights
        used outside their layer all fail it; mixing that appears only in larger batches cannot be seen."""
        was_training = self.module.training
        self.module.train()  # the mode it trains in, whatever mode it was handed over in
        try:
            losses, records = self._run(batch, loss_fn)
        finally:
            self.module.train(was_training)
        n = len(losses)
        if n < 2:  # one example cannot show mixing; accumulate checks the first larger batch
            return
        grads = torch.autograd.grad(losses.sum(), [edge for _, _, edge in records], retain_graph=True,
                                    allow_unused=True)
        layers = self._by_layer(records, grads, n)
        params = [p for m in self.layers for p in m.parameters(recurse=False) if p.requires_grad]
        tolerance = max(1e-4, 16 * torch.finfo(params[0].dtype).eps)
        exact = torch.promote_types(params[0].dtype, torch.float32)
        for k in range(n):
            mine: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # parameter id -> (row k's gradient, its |terms|)
            for m, (a, g) in layers.items():
                ak, gk = _as_sequence(a, n)[k].to(exact), _as_sequence(g, n)[k].to(exact)
                if m.weight.requires_grad:
                    mine[id(m.weight)] = (gk.t() @ ak, gk.abs().t() @ ak.abs())
                if m.bias is not None and m.bias.requires_grad:
                    mine[id(m.bias)] = (gk.sum(0), gk.abs().sum(0))
            own = torch.autograd.grad(losses[k], params, retain_graph=True, allow_unused=True)
            for p, ref in zip(params, own):
                ref = torch.zeros(p.shape, device=p.device, dtype=exact) if ref is None else ref.to(exact)
                got, magnitude = mine.get(id(p), (torch.zeros_like(ref), torch.zeros_like(ref)))
                # rounding grows with the terms summed, not with their (possibly cancelling) sum; in half precision
                # small entries underflow, hence the floor at the parameter's largest term
                bound = tolerance * (ref.abs() + magnitude + float(magnitude.max()) * tolerance) + 1e-12
                if not bool(((got - ref).abs() <= bound).all()):
                    raise WorkbenchError(
                        f"grad_sample_mode=bk: example {k}'s gradient of {self.names[id(p)]!r} is not its own: the "
                        "model mixes examples (across the batch, in a layer or the loss), feeds a layer time-major, "
                        "or uses the weight outside its layer; per-sample clipping cannot apply")
        self.checked = True

    def accumulate(self, batch, loss_fn: LossFn, view_of: dict[int, torch.Tensor]) -> torch.Tensor:
        """Add the micro-batch's clipped gradient sum into ``view_of`` (parameter id -> gradient buffer view)."""
        if not self.checked:  # GradientStep.check normally did this before training
            self.check(batch, loss_fn)
        losses, records = self._run(batch, loss_fn)
        n = len(losses)
        grads = torch.autograd.grad(losses.sum(), [edge for _, _, edge in records], allow_unused=True)
        layers = self._by_layer(records, grads, n)
        dtype = next(iter(view_of.values())).dtype
        norms2 = torch.zeros(n, device=losses.device, dtype=torch.promote_types(dtype, torch.float32))
        for m, (a, g) in layers.items():
            a, g = a.to(norms2.dtype), g.to(norms2.dtype)  # no-ops in float32/64; under autocast, bf16 -> float32
            if a.dim() == 2:  # ||g a^T||^2 = ||a||^2 ||g||^2; the bias gradient is g itself
                gg = torch.linalg.vecdot(g, g)
                if m.weight.requires_grad:
                    norms2.addcmul_(torch.linalg.vecdot(a, a), gg)
                if m.bias is not None and m.bias.requires_grad:
                    norms2.add_(gg)
                continue
            if m.weight.requires_grad:
                norms2.add_(torch.bmm(g.transpose(1, 2), a).to(norms2.dtype).square().sum((1, 2)))
            if m.bias is not None and m.bias.requires_grad:
                bias_grad = g.sum(1).to(norms2.dtype)
                norms2.add_(torch.linalg.vecdot(bias_grad, bias_grad))
        factor = clip_factors(norms2.sqrt_(), self.clip)
        for m, (a, g) in layers.items():
            # out of place: autograd may hand the same gradient tensor to two layers (z = a(x) + b(x))
            scaled = (g.to(factor.dtype) * factor.view(-1, *[1] * (g.dim() - 1))).to(dtype).reshape(-1, g.shape[-1])
            if m.weight.requires_grad:
                view_of[id(m.weight)].addmm_(scaled.t(), a.reshape(-1, a.shape[-1]).to(dtype))
            if m.bias is not None and m.bias.requires_grad:
                view_of[id(m.bias)].add_(scaled.sum(0))
        return losses.detach()
