"""The normalisation layers' rules (LayerNorm, RMSNorm, GroupNorm): their affine parameters' per-sample gradients
are small, so always formed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.privacy.clipping.layers.common import abs_if, precise, trainable


class Materialised:
    """For layers whose per-sample gradients are small (normalisation affine parameters): always formed."""

    @staticmethod
    def keeps(m, a, g) -> bool:
        return False

    def per_sample(self, m: nn.Module, a: torch.Tensor, g: torch.Tensor, absolute: bool = False) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def sample(self, m, calls, k, absolute=False):
        out: dict[str, torch.Tensor] = {}
        for a, g in calls:
            for name, gs in self.per_sample(m, a[k:k + 1], g[k:k + 1], absolute).items():
                out[name] = out[name] + gs[0] if name in out else gs[0]
        return out


class LayerNormRule(Materialised):
    """nn.LayerNorm (and nn.RMSNorm): weight gradient sum over positions of g * x_hat, bias gradient sum of g;
    x_hat from the forward's own statistics where book-keeping hands them over (``saved``), else recomputed from the
    layer's input (the pre-run check's route, RMSNorm, half precision)."""

    @staticmethod
    def saved(m, a: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The forward's own per-row mean and 1/std, which autograd saved for the backward (float32/64 LayerNorm whose
        output is layer_norm's of this very input), else None: x_hat without a second layer_norm (measured 150 us of
        the vit preset's 260 per call)."""
        fn = out.grad_fn
        if type(fn).__name__ != "NativeLayerNormBackward0" or a.dtype not in (torch.float32, torch.float64):
            return None
        try:  # saved-tensor hooks (offloading, checkpointing) may not unpack outside the backward: recompute then
            x, mean, rstd = fn._saved_input, fn._saved_result1, fn._saved_result2
        except RuntimeError:
            return None
        if x.data_ptr() != a.data_ptr() or x.shape != a.shape or mean.dtype != a.dtype:
            return None
        return mean, rstd

    def per_sample(self, m, a, g, absolute=False, saved=None):
        shape = m.normalized_shape
        a32, g32 = precise(a), precise(g)
        if saved is not None:  # x_hat = (x - mean) / std, as layer_norm computes it, from the forward's own statistics
            x_hat = (a32 - saved[0]).mul_(saved[1])
        else:
            x_hat = F.rms_norm(a32, shape, eps=m.eps) if isinstance(m, nn.RMSNorm) else F.layer_norm(a32, shape, eps=m.eps)
        keep = tuple(range(1, a.dim() - len(shape)))
        x_hat, g32 = abs_if(x_hat, absolute), abs_if(g32, absolute)
        names = trainable(m)
        out = {"weight": (g32 * x_hat).sum(keep) if keep else g32 * x_hat} if "weight" in names else {}
        if "bias" in names:
            out["bias"] = g32.sum(keep) if keep else g32
        return out


class GroupNormRule(Materialised):
    """nn.GroupNorm: per channel, weight gradient sum over positions of g * x_hat, bias gradient sum of g. x_hat is
    recomputed by group_norm (reading the forward's saved statistics instead measured 1.4-1.5x slower on ResNet-18's
    shapes: two elementwise passes against group_norm's fused kernel), then multiplied by g in place (vecdot, which
    allocates the products, measured 1.2-1.35x slower at 128-512 channels on 16x16 to 4x4)."""

    def per_sample(self, m, a, g, absolute=False):
        g32 = abs_if(precise(g), absolute)
        names = trainable(m)
        out = {}
        if "weight" in names:
            x_hat = abs_if(F.group_norm(precise(a), m.num_groups, eps=m.eps), absolute)
            out["weight"] = x_hat.mul_(g32).flatten(2).sum(2) if a.dim() > 2 else x_hat.mul_(g32)
        if "bias" in names:
            out["bias"] = g32.flatten(2).sum(2) if a.dim() > 2 else g32
        return out
