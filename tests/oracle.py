"""The per-example definition of the clipped sum, written once: every test that checks a clipped sum asks this oracle.

The definition: each example's own gradient (autograd on its loss alone, one example at a time), over the model's
trainable parameters, scaled by min(1, C / ||g||) (the flat L2 norm over all of them), summed. :func:`clipped_sum`
computes it in float64 on a copy of the model (the model handed in is not changed): an independent reference, more
exact than any float32 route it is compared with.

The certified floating-point bound (workbench/privacy/clipping/bound.py) clips each example against an upper bound on the
norm of what its kernel adds, so an example is clipped up to gamma_K S / N harder than its exact norm asks (README:
0.004 % on the MLP to about 0.15 % on the tiny BERT; the toy layers here sit in that range). A clipped sum is compared with
the float64 per-example definition within ``CLIPPED_RTOL``: room for that margin, far below what a wrong norm, a
missing term or an unclipped example moves it by.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterable, NamedTuple

import torch
from torch import nn

CLIPPED_RTOL = 3e-3


class ClippedSum(NamedTuple):
    grads: list[torch.Tensor]  # one per trainable parameter, in the order of model.parameters()
    clipped: int  # how many examples' norms exceeded the clip (a comparison means something only when it bites)


def rows(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """A batch of tensors (inputs..., labels) as its examples, one at a time, each a batch of one."""
    return [tuple(t[i:i + 1] for t in tensors) for i in range(len(tensors[0]))]


def cross_entropy(model: nn.Module, example: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """One ``(inputs..., label)`` example's loss: cross-entropy of the model's logits (its output or ``.logits``)."""
    *inputs, label = example
    out = model(*inputs)
    return nn.functional.cross_entropy(getattr(out, "logits", out), label)


def _to(example: Any, dtype: torch.dtype) -> Any:
    """``example`` with its floating-point tensors in ``dtype`` (token ids, masks and labels as they are)."""
    if isinstance(example, torch.Tensor):
        return example.to(dtype) if example.is_floating_point() else example
    if isinstance(example, dict):
        return {k: _to(v, dtype) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        return type(example)(_to(v, dtype) for v in example)
    return example


def clipped_sum(model: nn.Module, examples: Iterable[Any], clip: float,
                loss: Callable[[nn.Module, Any], torch.Tensor] = cross_entropy, *,
                dtype: torch.dtype = torch.float64) -> ClippedSum:
    """The clipped sum of ``examples`` by its definition, computed in ``dtype`` (float64 unless a test asks what a lower
    precision can do; the sums then accumulate in float32).

    ``examples``: each one example as ``loss`` reads it (``rows(x, y)`` for tensors; a mapping for HF-style batches);
    its floating-point tensors are moved to ``dtype``. ``loss(model, example)``: that example's loss alone, a scalar.
    A trainable parameter the example does not reach gets a zero gradient."""
    model = copy.deepcopy(model).to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    acc = torch.promote_types(dtype, torch.float32)
    total = [torch.zeros_like(p, dtype=acc) for p in params]
    clipped = 0
    for example in examples:
        grads = torch.autograd.grad(loss(model, _to(example, dtype)), params, allow_unused=True)
        grads = [torch.zeros_like(p, dtype=acc) if g is None else g.to(acc) for p, g in zip(params, grads)]
        norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
        assert math.isfinite(norm), "the definition is for finite gradients; leave non-finite examples out"
        clipped += norm > clip
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        for t, g in zip(total, grads):
            t += factor * g
    return ClippedSum(total, clipped)
