"""grad_sample_mode=vmap: per-example gradients of the whole model by ``torch.func`` (vmap over grad of one example's
loss), the universal route. It needs no rule per layer and no hook, so it covers what the per-layer modes cannot see:
parameters used outside a layer and broadcast over the batch (learned positions looked up with ids shared by the
batch, cls tokens, position tables, layer-scale gammas, ReZero alphas), weights used by several layers, any layer
type (book-keeping now clips shared position ids and a user's own raw parameters too, by expanding them per example,
where its check passes: workbench/privacy/clipping/book_keeping.py). Each example's gradient is formed in full (memory: the batch times the trainable parameters), then clipped and
summed exactly as the other materialised modes are, from the very tensors summed
(:class:`~workbench.privacy.clipping.opacus_modes.PerSampleGradients`, :mod:`workbench.privacy.clipping.bound`).

``auto`` takes it last, when no faster mode's pre-run check passes (workbench/step.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from workbench.errors import WorkbenchError
from workbench.privacy.clipping.base import LossFn
from workbench.privacy.clipping.opacus_modes import PerSampleGradients


class _Functional:
    """The model called with the parameters vmap hands in (the others as they are)."""

    def __init__(self, model: nn.Module, params: dict, frozen: dict):
        self.model, self.state = model, {**frozen, **params}

    def __call__(self, *args, **kwargs):
        return torch.func.functional_call(self.model, self.state, args, kwargs)


class WholeModel(PerSampleGradients):
    """grad_sample_mode=vmap."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], clip: float):
        self.module, self.params, self.clip, self.mode = model, params, clip, "vmap"
        ids = {id(p) for p in params}
        self.names = [n for n, p in model.named_parameters() if id(p) in ids]
        self.randomness = "different"  # dropout: each example its own mask

    @property
    def plain(self) -> nn.Module:
        return self.module

    def _backward(self, batch, loss_fn: LossFn, checking: bool = True) -> torch.Tensor:
        model = self.module
        trained = dict(zip(self.names, (p.detach() for p in self.params)))
        frozen = {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()] if n not in trained}
        n = len(batch)
        tensors, dims, rebuild = _split(batch, n)

        def one(params, *values):
            example = rebuild([v.unsqueeze(0) if d == 0 else v for v, d in zip(values, dims)])
            loss = loss_fn(_Functional(model, params, frozen), example)
            return loss[0], loss[0].detach()

        try:
            grads, losses = torch.func.vmap(torch.func.grad(one, has_aux=True), in_dims=(None, *dims),
                                            randomness=self.randomness)(trained, *tensors)
        except WorkbenchError:
            raise
        except Exception as e:  # noqa: BLE001 - torch.func refuses what it cannot batch (in-place, .item(), ...)
            if not checking:
                raise
            raise WorkbenchError(f"grad_sample_mode=vmap cannot compute this model's per-sample gradients: "
                                 f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from e
        for name, p in zip(self.names, self.params):
            p.grad_sample = grads[name]
        return losses

    def check(self, batch, loss_fn: LossFn) -> None:
        """The materialised modes' check (each example's row against autograd's gradient of its loss alone), with
        dropout off: vmap draws each example's mask apart, the batched reference forward draws one for the batch."""
        with _without_dropout(self.module):
            super().check(batch, loss_fn)


def _split(batch, n: int):
    """The batch's tensors, their vmap dims (0: one row per example; None: shared) and how to rebuild a batch."""
    args, kwargs, labels = batch.args, batch.kwargs, batch.labels
    keys = list(kwargs)
    values = [*args, *kwargs.values(), labels]
    tensors = [v for v in values if torch.is_tensor(v)]
    dims = [0 if t.dim() > 0 and t.shape[0] == n else None for t in tensors]

    def rebuild(ts):
        it = iter(ts)
        filled = [next(it) if torch.is_tensor(v) else v for v in values]
        return type(batch)(tuple(filled[:len(args)]), dict(zip(keys, filled[len(args):-1])), filled[-1])

    return tensors, dims, rebuild


@contextmanager
def _without_dropout(model: nn.Module):
    dropouts = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    saved = [m.p for m in dropouts]
    for m in dropouts:
        m.p = 0.0
    try:
        yield
    finally:
        for m, p in zip(dropouts, saved):
            m.p = p
