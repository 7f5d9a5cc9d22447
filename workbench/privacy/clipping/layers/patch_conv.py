"""A patch convolution's rule (a ViT's patch embedding): a Linear on non-overlapping patches."""

from __future__ import annotations

import math

import torch
from torch import nn

from workbench.privacy.clipping.layers.common import per_example, precise, trainable
from workbench.privacy.clipping.layers.conv import ConvRule
from workbench.privacy.clipping.layers.linear import LinearRule


class PatchConvRule(ConvRule):
    """A patch convolution (kernel == stride, no padding, dilation 1, groups 1: a ViT's patch embedding) is a Linear on
    non-overlapping patches: a reshape and permutation of its input, no unfold. Its per-sample gradients,
    sum_l g_l U_l^T, are one batched matmul over the L patches; they are formed wherever they take at most ``FORM_IF``
    times the memory of a and g or at most ``SMALL_FORMED`` entries per example. Formed gradients are what
    is summed, so their bound is the materialised one; larger patch convolutions keep a and g and take ConvRule's
    kept route unchanged. The pre-run check's route stays ConvRule's (F.unfold)."""

    FORM_IF = LinearRule.FORM_IF  # a Linear on patches
    SMALL_FORMED = ConvRule.CHUNK_ELEMENTS // 512  # per-example entries formed whatever a and g take: a micro-batch of
    # 512 holds no more than the kept route's own chunk of formed gradients (the vit preset's 544 against a and g's 192)

    @staticmethod
    def applies(m: nn.Module) -> bool:
        padding = m.padding == "valid" or not any(m.padding)
        return padding and tuple(m.kernel_size) == tuple(m.stride) and all(d == 1 for d in m.dilation) and m.groups == 1

    def keeps(self, m, a, g) -> bool:
        formed = sum(getattr(m, name).numel() for name in trainable(m))
        return formed > self.SMALL_FORMED and self.FORM_IF * (per_example(a) + per_example(g)) < formed

    @staticmethod
    def patches(m, a: torch.Tensor) -> torch.Tensor:
        """(n, C_in, *spatial) -> (n, L, C_in * prod(k)), the columns in the weight's (C_in, *k) order (positions past
        the last whole patch, which the layer ignores, cut), by one permuted copy."""
        k, n, c = tuple(m.kernel_size), len(a), a.shape[1]
        out = [size // kk for size, kk in zip(a.shape[2:], k)]
        if any(o * kk != size for o, kk, size in zip(out, k, a.shape[2:])):
            a = a[(..., *[slice(0, o * kk) for o, kk in zip(out, k)])]
        split = a.reshape(n, c, *[d for o, kk in zip(out, k) for d in (o, kk)])
        dims = len(k)
        order = (0, *[2 + 2 * i for i in range(dims)], 1, *[3 + 2 * i for i in range(dims)])
        return split.permute(order).reshape(n, math.prod(out), c * math.prod(k))

    def per_sample(self, m, a, g):
        """Weight gradients of each example in one batched matmul (contiguous: stacked or normed without a copy);
        bias gradients sum_l g_l as one matrix-vector product with 1s (a sum over few positions measured 2x slower)."""
        names, n = trainable(m), len(a)
        g = precise(g).reshape(n, g.shape[1], -1)  # (n, C_out, L)
        out = {}
        if "weight" in names:
            out["weight"] = torch.bmm(g, self.patches(m, precise(a))).view(n, *m.weight.shape)
        if "bias" in names:
            out["bias"] = torch.mv(g.reshape(-1, g.shape[2]), g.new_ones(g.shape[2])).view(n, g.shape[1])
        return out
