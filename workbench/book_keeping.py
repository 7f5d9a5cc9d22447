"""Book-keeping per-sample clipping (Bu et al., 2023) for models whose trainable layers are all ``nn.Linear``.

One forward keeps each Linear's input a; one backward asks autograd for dL/dz at each Linear output z only (no weight
gradients, no second pass). Per example i, a (B, d) input gives ||g_i a_i^T||^2 = ||a_i||^2 ||g_i||^2 in closed form;
a (B, T, d) input, or a layer called more than once, forms the per-sample gradient sum_t g_it a_it^T (exact and never
negative, unlike the Gram-matrix "ghost" norm in float32). The clipped sum sum_i f_i g_i a_i^T is one matmul per layer.

It relies on what every per-sample mode relies on -- a Linear's input rows are examples, one loss per example -- and on
seeing every use of a weight. :meth:`BookKeeping.check` verifies both on a real batch before training.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

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


class BookKeeping:
    def __init__(self, model: nn.Module, clip: float):
        self.model, self.clip = model, clip
        self.layers = trainable_layers(model)
        why = refusal(self.layers)
        if why:
            raise WorkbenchError(f"grad_sample_mode=bk {why}: use grad_sample_mode=auto")
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.checked = False

    def _forward(self, x: torch.Tensor, keep: Callable) -> torch.Tensor:
        handles = [m.register_forward_hook(keep, with_kwargs=True) for m in self.layers]
        try:
            return self.model(x)
        finally:
            for h in handles:
                h.remove()

    def check_batch_first(self, x: torch.Tensor) -> None:
        """Every Linear input's rows must be the examples: dim 0 follows the batch (1, then 2) and example 0's row
        does not change when example 1 joins. Time-major inputs, shared tables and batch-mixing layers fail here."""
        runs: list[list[tuple[nn.Module, torch.Tensor]]] = [[], []]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for k, run in zip((1, 2), runs):
                    self._forward(x[:k], lambda m, args, kwargs, out, run=run: run.append((m, _input(args, kwargs))))
        finally:
            self.model.train(was_training)
        for (m, one), (_, two) in zip(*runs):
            name = self.names[id(m.weight)].removesuffix(".weight")
            if one.shape[0] != 1 or two.shape[0] != 2:
                raise WorkbenchError(f"grad_sample_mode=bk needs batch-first inputs: layer {name!r} got "
                                     f"{tuple(two.shape)} for 2 examples; make the model batch-first")
            if not torch.allclose(one[0], two[0], rtol=1e-3, atol=1e-5 * (1.0 + float(two.abs().max()))):
                raise WorkbenchError(f"grad_sample_mode=bk: layer {name!r} sees inputs that mix examples (its row "
                                     "for example 0 changes when example 1 joins); per-sample clipping cannot apply")

    def _run(self, x: torch.Tensor, y: torch.Tensor, losses_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        """Forward with the recording hooks; returns the per-example losses and, per layer that ran, its input and the
        autograd edge of its output (the edge, not the tensor: memory like a non-private step's)."""
        records: list[tuple[nn.Module, torch.Tensor, object]] = []

        def keep(m, args, kwargs, out):
            if not out.requires_grad:
                raise WorkbenchError("grad_sample_mode=bk: gradients are disabled in the model's forward (no_grad?)")
            records.append((m, _input(args, kwargs).detach(), get_gradient_edge(out)))

        losses = losses_of(self._forward(x, keep), y)
        if not records:
            raise WorkbenchError("grad_sample_mode=bk: no nn.Linear layer ran in the model's forward")
        return losses, records

    def _layers(self, records: list, grads: tuple, n: int) -> dict[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (a, g) as (B, features), or (B, T, features) for a sequence or a layer called more than once."""
        layers: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        for (m, a, _), g in zip(records, grads):
            if g is None:  # this output did not reach the loss
                continue
            if a.shape[0] != n:
                raise WorkbenchError(f"grad_sample_mode=bk needs batch-first inputs: layer "
                                     f"{self.names[id(m.weight)].removesuffix('.weight')!r} got {tuple(a.shape)} "
                                     f"for a batch of {n}; make the model batch-first")
            if m in layers:
                a, g = (torch.cat([_as_sequence(old, n), _as_sequence(new, n)], 1) for old, new in zip(layers[m], (a, g)))
            elif a.dim() > 2:
                a, g = _as_sequence(a, n), _as_sequence(g, n)
            layers[m] = (a, g)
        return layers

    def check(self, x: torch.Tensor, y: torch.Tensor,
              losses_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """On a real batch: rows are examples, and bk's unclipped sums equal autograd's gradients."""
        if len(y) < 2:  # one example cannot show rows mixing; accumulate checks the first larger batch
            return
        self.check_batch_first(x)
        losses, records = self._run(x, y, losses_of)
        params = [p for m in self.layers for p in m.parameters(recurse=False) if p.requires_grad]
        reference = torch.autograd.grad(losses.sum(), params, retain_graph=True, allow_unused=True)
        grads = torch.autograd.grad(losses.sum(), [edge for _, _, edge in records], allow_unused=True)
        self._check_sums(self._layers(records, grads, len(y)), dict(zip(map(id, params), reference)))
        self.checked = True

    def accumulate(self, x: torch.Tensor, y: torch.Tensor, losses_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   view_of: dict[int, torch.Tensor]) -> torch.Tensor:
        """Add the micro-batch's clipped gradient sum into ``view_of`` (parameter id -> gradient buffer view);
        ``losses_of(output, y)`` gives the per-example losses."""
        n = len(y)
        if not self.checked and n >= 2:  # GradientStep.check normally did this before training
            self.check(x, y, losses_of)
        losses, records = self._run(x, y, losses_of)
        grads = torch.autograd.grad(losses.sum(), [edge for _, _, edge in records], allow_unused=True)
        layers = self._layers(records, grads, n)
        norms2 = torch.zeros(n, device=y.device, dtype=next(iter(view_of.values())).dtype)
        for m, (a, g) in layers.items():
            if a.dim() == 2:  # ||g a^T||^2 = ||a||^2 ||g||^2; the bias gradient is g itself
                gg = torch.linalg.vecdot(g, g)
                if m.weight.requires_grad:
                    norms2.addcmul_(torch.linalg.vecdot(a, a), gg)
                if m.bias is not None and m.bias.requires_grad:
                    norms2.add_(gg)
                continue
            if m.weight.requires_grad:
                norms2.add_(torch.bmm(g.transpose(1, 2), a).square().sum((1, 2)))
            if m.bias is not None and m.bias.requires_grad:
                bias_grad = g.sum(1)
                norms2.add_(torch.linalg.vecdot(bias_grad, bias_grad))
        factor = norms2.sqrt_().add_(1e-6).reciprocal_().mul_(self.clip).clamp_(max=1.0)  # min(1, C / ||g_i||)
        for m, (a, g) in layers.items():
            # out of place: autograd may hand the same gradient tensor to two layers (z = a(x) + b(x))
            scaled = (g * factor.view(-1, *[1] * (g.dim() - 1))).reshape(-1, g.shape[-1])
            if m.weight.requires_grad:
                view_of[id(m.weight)].addmm_(scaled.t(), a.reshape(-1, a.shape[-1]))
            if m.bias is not None and m.bias.requires_grad:
                view_of[id(m.bias)].add_(scaled.sum(0))
        return losses.detach()

    def _check_sums(self, layers: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]],
                    reference: dict[int, torch.Tensor | None]) -> None:
        """bk's unclipped sums must equal autograd's gradients: a weight also used outside its Linear call (say
        ``x @ fc.weight.T``), or an input changed in place after the call, would otherwise train silently wrong."""
        mine: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # parameter id -> (sum, sum of |terms|)
        for m, (a, g) in layers.items():
            g2, a2 = g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1])
            if m.weight.requires_grad:
                mine[id(m.weight)] = (g2.t() @ a2, g2.abs().t() @ a2.abs())
            if m.bias is not None and m.bias.requires_grad:
                mine[id(m.bias)] = (g2.sum(0), g2.abs().sum(0))
        for pid, ref in reference.items():
            got, magnitude = mine.get(pid, (None, None))
            if ref is None and got is None:
                continue
            ref = torch.zeros_like(got) if ref is None else ref
            if got is None:
                got = magnitude = torch.zeros_like(ref)
            # float rounding grows with the terms summed, not with their (possibly cancelling) sum
            if not bool(((got - ref).abs() <= 1e-3 * ref.abs() + 1e-4 * magnitude + 1e-12).all()):
                raise WorkbenchError(f"grad_sample_mode=bk does not see every use of {self.names[pid]!r}: it is used "
                                     "outside its nn.Linear call, or that call's input is changed in place after it; "
                                     "per-sample clipping needs each weight used only through its own layer")
