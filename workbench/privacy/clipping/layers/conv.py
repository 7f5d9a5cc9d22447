"""nn.Conv1d / nn.Conv2d's rule: per-sample gradients by the layer's own kernel, or a and g kept (their norms by
formed gradients or the Gram trick)."""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn.functional as F

from workbench.privacy.clipping.bound import (SUBNORMAL, UNDERFLOW, U64, Bound, example_norms, gamma, diagonal_norms,
                                              gram32_margin, squares)
from workbench.privacy.clipping.layers.common import (abs_if, cat, kernel_depth, per_call, per_example, precise,
                                                      smaller_kept, trainable, weighted_sum)


class _ConvState(list):
    """A kept conv layer's prepared calls [(padded input, padding, g)], and the per-sample weight gradients its norms
    were formed from, chunks of examples in order, (k, P) each, when the rule keeps them for the clipped sum
    (``ConvRule.STASH_IF``), else None."""

    formed: list[torch.Tensor] | None = None
    tap_major = False  # formed by shifts or patches: columns in (kernel offset, channel) order


class ConvRule:
    """nn.Conv1d / nn.Conv2d. Per-sample gradients by the layer's own weight-gradient kernel (convolution_backward) with
    the examples folded into the groups: one call, no unfolded patches (measured 2-6x faster than unfold + batched
    matmul on the ResNet preset's stride-1 layers). Kept instead where a and g are smaller (many channels on few positions); their norms
    then come from per-sample gradients formed a chunk of examples at a time, or, where cheaper (``use_gram``), by
    the Gram trick ||g_i U_i^T||^2 = sum_{l,l'} (U_i^T U_i)(g_i^T g_i) on unfolded patches U_i, in float64 against
    cancellation; their clipped sum is the layer's weight-gradient kernel on the clip-scaled output gradient, or
    patches @ scaled g where that kernel is slow (``PATCH_SUM_IF``), or, where the norms came from per-sample gradients
    small enough to keep (``STASH_IF``), one matrix-vector product of those. Each choice is by measured cost per
    layer shape, never by the data: the routes are public."""

    CHUNK_ELEMENTS = 2 ** 21  # patches and Gram matrices (float64) or per-sample gradients formed at once for kept
    # calls' norms: 8-16 MiB (2^18 formed ResNet-18's wide layers one example at a time, Python-bound)
    GROUPED_CHANNELS = 1024  # output channels of one weight-gradient kernel with examples folded into its groups:
    # oneDNN's grouped kernel measured 1.2-3x slower per example past it (ResNet-18's 128-512-channel layers)
    GRAM_IF = 1.0  # Gram when GRAM_IF * L^2 (C_in k + C_out) < L C_in k C_out per group (flops; the small CNN's
    # kept layer measured alike either way, a wide 256-channel 4x4 layer 3x faster by Gram)
    PATCH_SUM_IF = 512  # the clipped sum by patches @ scaled g (one matmul per group) where the weight has at least
    # this many entries per (example, position) term it reduces over: oneDNN's weight-gradient kernel measured slower
    # there (weight / (n L) = 576 to 9216: 1.05x-4x the matmul's time with the patch copy), faster at 144 (0.6x)
    PATCH_FORM_CHANNELS = 128  # kept calls' per-sample gradients for their norms formed as g_i @ U_i (at stride 1 a
    # matmul per example and kernel tap on shifted input rows, else a batched matmul on patches) where an ungrouped
    # layer has at least this many output channels (the matmul's rows), else by the grouped kernel: 128-channel 16x16
    # layers measured 1.3-1.7x faster so (patches), 64-channel 32x32 ones 2x slower (a 64->128 strided layer alike)
    TIGHT = 2.0 ** -6  # the float32 Gram route's margin accepted up to this share of the squared norm (an example
    # clipped at most 0.8 % below C): the margin grows with C_in k (2304 at 256 channels), 0.3-1 % measured on
    # ResNet-18's Gram layers, where LinearRule.TIGHT (2^-8) sent every example to float64 (1.4-1.8x slower)
    STASH_IF = 2.5  # kept calls whose norms come from formed per-sample gradients keep those for the clipped sum (one
    # matrix-vector product, not a second weight-gradient kernel) where they take at most this many times a and g:
    # formed after the backward, when the activations autograd saved are freed (ResNet-18's 128-channel 16x16 layers,
    # 2.25x: 70 ms -> 4 ms each per 64 examples, peak memory unchanged)

    @staticmethod
    def keeps(m, a, g) -> bool:
        return smaller_kept(m, a, g)

    @staticmethod
    def _padded(m, a: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The input as the layer pads it ("same" may be uneven, padding modes other than zeros) and what padding
        the convolution itself then applies."""
        if m.padding_mode != "zeros" or isinstance(m.padding, str):
            mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
            return F.pad(a, m._reversed_padding_repeated_twice, mode=mode), (0,) * len(m.kernel_size)
        return a, tuple(m.padding)

    @staticmethod
    def _weight_grad(m, x, padding, g, examples: int = 1) -> torch.Tensor:
        """The weight gradient by the layer's own kernel: summed over the batch, or (``examples`` = n) per example,
        (n * C_out, C_in / groups, *k), by folding the examples into the groups."""
        if examples > 1:
            x, g = x.reshape(1, -1, *x.shape[2:]), g.reshape(1, -1, *g.shape[2:])
        return torch.ops.aten.convolution_backward(
            g, x, x.new_empty(1).expand(examples * m.weight.shape[0], *m.weight.shape[1:]), None, m.stride, padding,
            m.dilation, False, (0,) * len(padding), m.groups * examples, (False, True, False))[1]

    def folded(self, m) -> int:
        """Examples folded into one grouped weight-gradient kernel (see GROUPED_CHANNELS)."""
        return max(1, self.GROUPED_CHANNELS // m.out_channels)

    def _per_example_weights(self, m, x, padding, g) -> torch.Tensor:
        """(n, *weight.shape) per-sample weight gradients, ``folded`` examples per kernel call."""
        n, k = len(x), self.folded(m)
        if n <= k:
            return self._weight_grad(m, x, padding, g, n).view(n, *m.weight.shape)
        out = g.new_empty(n, *m.weight.shape)
        for s in range(0, n, k):
            xs, gs = x[s:s + k], g[s:s + k]
            out[s:s + len(gs)] = self._weight_grad(m, xs, padding, gs, len(gs)).view(len(gs), *m.weight.shape)
        return out

    def per_sample(self, m, a, g):
        n, names = len(a), trainable(m)
        g = precise(g)
        out = {}
        if "weight" in names:
            x, padding = self._padded(m, precise(a))
            out["weight"] = self._per_example_weights(m, x, padding, g)
        if "bias" in names:
            out["bias"] = g.flatten(2).sum(2)
        return out

    def prepare(self, m, calls, n):
        return _ConvState((*self._padded(m, precise(a)), precise(g)) for a, g in calls)

    def stashes(self, m, state) -> bool:
        """Whether the per-sample weight gradients formed for the norms are kept for the clipped sum (``STASH_IF``)."""
        return m.weight.numel() <= self.STASH_IF * sum(per_example(x) + per_example(g) for x, _, g in state)

    def use_gram(self, m, length: int) -> bool:
        """Per-sample norms by the Gram trick (else from per-sample gradients) at L output positions (all calls)."""
        p = m.in_channels // m.groups * math.prod(m.kernel_size)
        d = m.out_channels // m.groups
        return self.GRAM_IF * length * (p + d) < p * d

    @staticmethod
    def by_inputs(m, x: torch.Tensor, padding, length: int) -> bool:
        """Whether the Gram route takes the patches' Gram from the input positions' Gram (:meth:`_input_gram_norms`):
        C_in Lp^2 products against the patches' C_in k L^2 (fewer on stride-1 3x3 layers at 8x8 and below: 2-3x
        faster on ResNet-18's, where a strided layer's input has 4x its output's positions and loses)."""
        lp = math.prod(size + 2 * q for size, q in zip(x.shape[2:], padding))
        return lp * lp < math.prod(m.kernel_size) * length * length

    def _input_grams(self, m, x: torch.Tensor, padding, g: torch.Tensor, dtype: torch.dtype):
        """One call's per-example Gram matrices of the patches, U^T U, and of g, (n, groups, L, L) each in ``dtype``,
        without patches: U_l^T U_l' = sum_k P[s l + d k, s l' + d k] over the kernel offsets k (stride s, dilation d),
        P = X^T X the Gram of the zero-padded input's positions, per group. The same products as the patches' Gram,
        each entry summed over C_in / groups + k terms."""
        if any(padding):
            x = F.pad(x, [q for p in reversed(padding) for q in (p, p)])
        n, spatial, out = len(x), tuple(x.shape[2:]), tuple(g.shape[2:])
        xs = x.to(dtype).reshape(n, m.groups, -1, math.prod(spatial))
        inputs = (xs.transpose(-1, -2) @ xs).view(n, m.groups, *spatial, *spatial)
        gs = g.to(dtype).reshape(n, m.groups, -1, math.prod(out))
        patches = None  # U^T U, as (n, groups, *out, *out)
        for offset in itertools.product(*[range(k) for k in m.kernel_size]):
            rows = tuple(slice(o * d, o * d + (size - 1) * st + 1, st)
                         for o, d, size, st in zip(offset, m.dilation, out, m.stride))
            view = inputs[(slice(None), slice(None), *rows, *rows)]
            patches = view.clone() if patches is None else patches.add_(view)
        length = math.prod(out)
        return patches.view(n, m.groups, length, length), gs.transpose(-1, -2) @ gs

    def _input_gram_norms(self, m, x: torch.Tensor, padding, g: torch.Tensor) -> torch.Tensor:
        """(n,) float64 squared norms of one call's per-sample weight gradients sum_l g_l U_l^T, by the Gram trick
        without patches (:meth:`_input_grams`; bound: gamma64 of depth p + k + C_out + L^2 + 2)."""
        patches, outputs = self._input_grams(m, x, padding, g, torch.float64)
        return patches.mul_(outputs).flatten(1).sum(1).clamp_(min=0)

    def _gram64_norms(self, m, chunk, by_inputs: bool) -> torch.Tensor:
        """(n,) float64 squared norms of a chunk's per-sample weight gradients by the Gram trick in float64 (exact
        copies of x and g), the calls joined along positions, or by the input positions' Gram (one call)."""
        if by_inputs:
            return self._input_gram_norms(m, *chunk[0])
        u = cat([self._patches_as(m, x, padding, torch.float64) for x, padding, _ in chunk], -1)
        g = cat([g.double().reshape(len(g), m.groups, -1, math.prod(g.shape[2:])) for _, _, g in chunk], -1)
        return (u.transpose(-1, -2) @ u).mul_(g.transpose(-1, -2) @ g).sum((1, 2, 3)).clamp_(min=0)

    def _gram32_norms(self, m, chunk, by_inputs: bool) -> torch.Tensor:
        """:meth:`_gram64_norms` of an ungrouped float32 layer as upper bounds, from float32 Gram matrices (measured
        1.5-3x faster on ResNet-18's 8x8 and strided layers). Each entry of U^T U is a float32 sum of p = C_in k
        products (by inputs C_in + k - 1 <= p roundings deep), each of g^T g of C_out; so their products summed in
        float64 are within :func:`~workbench.privacy.clipping.bound.gram32_margin` (d_in = p, d_out = C_out, position
        norms from the diagonals) of the exact squared norm, and max(sum, 0) + margin bounds it. An example whose margin
        is not within ``TIGHT`` of its sum (terms that cancel) is recomputed by the float64 route."""
        if by_inputs:
            uu, gg = self._input_grams(m, *chunk[0], torch.float32)
        else:
            u = cat([self._patches_as(m, x, padding, torch.float32) for x, padding, _ in chunk], -1)
            g = cat([g.reshape(len(g), 1, -1, math.prod(g.shape[2:])) for _, _, g in chunk], -1)
            uu, gg = u.transpose(-1, -2) @ u, g.transpose(-1, -2) @ g
        uu, gg, p = uu[:, 0], gg[:, 0], m.in_channels * math.prod(m.kernel_size)
        n2 = uu.double().mul_(gg.double()).sum((1, 2))
        margin = gram32_margin(diagonal_norms(uu, p), diagonal_norms(gg, m.out_channels), p, m.out_channels)
        bound = (n2.clamp(min=0) + margin).mul_(1.0 + 4 * U64)  # the two float64 roundings here, rounded up
        loose = ~(margin <= self.TIGHT * n2)  # NaN (inf - inf) included
        if bool(loose.any()):
            rows = loose.nonzero().flatten()
            bound[rows] = self._gram64_norms(m, [(x[rows], padding, g[rows]) for x, padding, g in chunk], by_inputs)
        return bound

    def _patches(self, m, x: torch.Tensor, padding) -> torch.Tensor:
        """(n, C_in, *spatial) -> (n, groups, C_in/groups * k, L): unfold's channel-major order is the weight's."""
        one_d = x.dim() == 3
        u = F.unfold(x.unsqueeze(2) if one_d else x, (1, *m.kernel_size) if one_d else m.kernel_size,
                     dilation=(1, *m.dilation) if one_d else m.dilation, padding=(0, *padding) if one_d else padding,
                     stride=(1, *m.stride) if one_d else m.stride)
        return u.view(len(x), m.groups, -1, u.shape[-1])

    def _patches_as(self, m, x: torch.Tensor, padding, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`_patches` (the same values, same order) made by one strided copy into ``dtype``: F.unfold's im2col
        and a cast after it measured 2x slower on ResNet-18's 8x8 layers. The check keeps F.unfold, its own route."""
        if any(padding):
            x = F.pad(x, [q for p in reversed(padding) for q in (p, p)])
        out = [(size - d * (k - 1) - 1) // st + 1
               for size, k, d, st in zip(x.shape[2:], m.kernel_size, m.dilation, m.stride)]
        st = x.stride()
        windows = x.as_strided((len(x), x.shape[1], *m.kernel_size, *out),
                               (st[0], st[1], *[d * s for d, s in zip(m.dilation, st[2:])],
                                *[k * s for k, s in zip(m.stride, st[2:])]))
        u = torch.empty(windows.shape, dtype=dtype, device=x.device).copy_(windows)
        return u.view(len(x), m.groups, -1, math.prod(out))

    @staticmethod
    def _channels_last(x: torch.Tensor, padding, dtype: torch.dtype) -> torch.Tensor:
        """(n, *padded spatial, C_in): the input copied channels-last, zero-padded by ``padding``, into ``dtype``."""
        size = [s + 2 * q for s, q in zip(x.shape[2:], padding)]
        xc = x.new_zeros((len(x), *size, x.shape[1]), dtype=dtype)
        xc[(slice(None), *[slice(q, q + s) for q, s in zip(padding, x.shape[2:])])].copy_(x.movedim(1, -1))
        return xc

    def _patch_rows(self, m, x: torch.Tensor, padding, dtype: torch.dtype) -> torch.Tensor:
        """(n L, groups, k * C_in/groups) patches, position-major (the rows of the clipped sum's matmul), each row in
        (kernel offset, channel) order: the input copied channels-last (zero-padded) into ``dtype``, then one strided
        copy whose innermost runs are whole channel vectors (the weight's channel-major order, copied with a stride
        for every kernel tap, measured 2-3x slower on ResNet-18's 4x4 layers)."""
        n, c, dims = len(x), x.shape[1], x.dim() - 2
        xc = self._channels_last(x, padding, dtype)
        size = xc.shape[1:-1]
        out = [(s - d * (k - 1) - 1) // st + 1 for s, k, d, st in zip(size, m.kernel_size, m.dilation, m.stride)]
        st, per = xc.stride(), c // m.groups
        windows = xc.as_strided((n, *out, m.groups, *m.kernel_size, per),
                                (st[0], *[k * s for k, s in zip(m.stride, st[1:1 + dims])], per,
                                 *[d * s for d, s in zip(m.dilation, st[1:1 + dims])], 1))
        u = torch.empty(windows.shape, dtype=dtype, device=x.device).copy_(windows)
        return u.view(n * math.prod(out), m.groups, -1)

    def _formed_by_patches(self, m, x: torch.Tensor, padding, g: torch.Tensor) -> torch.Tensor:
        """(n, C_out, k * C_in) per-sample weight gradients g_i U_i of an ungrouped layer, columns in (kernel offset,
        channel) order (the weight's is (channel, kernel offset)): one batched matmul over each example's L terms."""
        u = self._patch_rows(m, x, padding, g.dtype)
        return torch.bmm(g.flatten(2), u.view(len(x), -1, u.shape[-1]))

    def _formed_by_shifts(self, m, x: torch.Tensor, padding, g: torch.Tensor) -> torch.Tensor:
        """:meth:`_formed_by_patches` of a stride-1 layer (the same tensor) without patches: per example and kernel
        tap one matmul g_i X_i, X_i a contiguous run of rows of the zero-padded input laid out channels-last and
        flattened over positions. Output position o reads row q(o) + shift(tap), q(o) = sum_d o_d S_d (S_d the padded
        input's position strides), so g is placed at q(o) in rows of zeros, Q = q(last) + 1 long: the rows between
        (wrap-around positions) multiply exact zeros, which leave every partial sum as it was, so each entry sums the
        same L products as by patches (bound.py: gamma_{L+1}). Measured 1.3-1.9x faster than patches @ g on
        ResNet-18's 128-channel 16x16 layers (the patch copy, 9x the input, was up to half the time); slower at
        stride 2, where the patches are 2.25x the input, not 9x."""
        n, c = len(x), x.shape[1]
        xc = self._channels_last(x, padding, g.dtype)
        rows = xc.view(n, -1, c)
        steps = [math.prod(xc.shape[2 + d:-1]) for d in range(x.dim() - 2)]
        out = g.shape[2:]
        q = sum((o - 1) * s for o, s in zip(out, steps)) + 1
        wide = g.new_zeros(n, g.shape[1], q)
        wide.as_strided((n, g.shape[1], *out), (g.shape[1] * q, q, *steps)).copy_(g)
        shifts = [sum(d * t * s for d, t, s in zip(m.dilation, tap, steps))
                  for tap in itertools.product(*[range(k) for k in m.kernel_size])]
        w = g.new_empty(n, g.shape[1], len(shifts), c)
        for i in range(n):  # a loop of mm measured 10% faster than a bmm per tap
            for j, shift in enumerate(shifts):
                torch.mm(wide[i], rows[i, shift:shift + q], out=w[i, :, j])
        return w.view(n, g.shape[1], -1)

    def _sum_by_patches(self, m, x: torch.Tensor, padding, scaled: torch.Tensor) -> torch.Tensor:
        """sum_i sum_l scaled_il U_il^T: the weight-gradient kernel's sum as a matmul over the same n L terms, as a
        view of the weight's shape (the matmul's columns are in (kernel offset, channel) order)."""
        u = self._patch_rows(m, x, padding, scaled.dtype)
        rows = scaled.flatten(2).transpose(1, 2).reshape(len(u), m.groups, -1)  # (n L, groups, C_out/groups)
        if m.groups == 1:
            w = rows[:, 0].t() @ u[:, 0]
        else:
            w = torch.bmm(rows.permute(1, 2, 0), u.transpose(0, 1))
        return w.view(m.out_channels, *m.kernel_size, -1).movedim(-1, 1)

    def _patch_squares(self, m, x: torch.Tensor, padding) -> torch.Tensor:
        """(n,) float64 upper bounds on sum_l ||U_l||^2 over the input patches U_l the output positions read (all
        channels), without unfolding: the channel-summed squares convolved with a kernel of ones, then summed."""
        sq = x.square().sum(1, keepdim=True).double()  # float32 squares (inf past 2^64) and channel sums: corrected
        ones = sq.new_ones(1, 1, *m.kernel_size)
        conv = F.conv1d if x.dim() == 3 else F.conv2d
        patch = conv(sq, ones, None, m.stride, padding, m.dilation).flatten(1)
        p = x.shape[1] * math.prod(m.kernel_size)
        return patch.sum(1).mul_((1.0 + gamma(x.shape[1] + 3)) * (1.0 + gamma(p * patch.shape[1] + 2, U64))).add_(
            patch.shape[1] * p * SUBNORMAL)

    def bound(self, m, state, n, batch):
        """Per-sample norms by the Gram trick in float64 (its rounding within gamma64_D S^2 of the squared norm) or
        from per-sample gradients formed in float32 (within gamma_L S of the exact); the clipped sum is the layer's
        weight-gradient kernel over n L positions (within gamma_{nL+2} S); S = sum_l ||g_l|| ||U_l||."""
        names = trainable(m)
        g0 = state[0][2]
        n2 = torch.zeros(n, device=g0.device, dtype=torch.float64)
        lengths = sum(math.prod(g.shape[2:]) for _, _, g in state)
        # S = sum_l ||g_l|| ||U_l|| <= ||g||_F ||U||_F (Cauchy-Schwarz): per-example passes, no per-position tensors
        g_norms = [example_norms(g) for _, _, g in state]
        g_rel = max(r for _, r in g_norms)
        gn = g_norms[0][0] if len(state) == 1 else torch.stack([t for t, _ in g_norms]).square_().sum(0).sqrt_()
        kernel = gamma(kernel_depth(batch, max(math.prod(g.shape[2:]) for _, _, g in state), len(state)))
        err = torch.zeros(n, device=g0.device, dtype=torch.float64)
        rel, floor = 0.0, 0.0
        if "weight" in names:
            patches = sum(self._patch_squares(m, x, padding) for x, padding, _ in state).sqrt_()
            magnitude = patches.mul_(gn).mul_((1 + g_rel) * (1 + 4 * U64))
            gram = self.use_gram(m, lengths)
            by_inputs = gram and len(state) == 1 and self.by_inputs(m, state[0][0], state[0][1], lengths)
            float32 = m.groups == 1 and all(x.dtype == g.dtype == torch.float32 for x, _, g in state)
            p = m.in_channels // m.groups * math.prod(m.kernel_size)
            depth = p + (math.prod(m.kernel_size) if by_inputs else 0) + m.out_channels + lengths ** 2 + 2
            formed = math.sqrt(gamma(depth, U64)) if gram else gamma(lengths + 1)
            err += (formed + kernel) * magnitude
            # chunks of examples bound the memory of patches and Gram matrices (float64) or per-sample gradients
            if by_inputs:
                lp = math.prod(size + 2 * q for size, q in zip(state[0][0].shape[2:], state[0][1]))
                per = m.groups * (lp * lp + 2 * lengths ** 2) + m.in_channels * lp + m.out_channels * lengths
                step = max(1, self.CHUNK_ELEMENTS // per)
            elif gram:
                per = 2 * m.groups * lengths ** 2 + (m.in_channels * math.prod(m.kernel_size) + m.out_channels) * lengths
                step = max(1, self.CHUNK_ELEMENTS // per)
            else:
                step = max(1, min(self.CHUNK_ELEMENTS // m.weight.numel(), self.folded(m)))
                if self.stashes(m, state):  # the clipped sum is then what the norms are of: rel + gamma_{batch+2}
                    state.formed = []
                state.tap_major = m.groups == 1 and m.out_channels >= self.PATCH_FORM_CHANNELS
                tap_major = self._formed_by_shifts if set(m.stride) == {1} else self._formed_by_patches
            for s in range(0, n, step):
                chunk = [(x[s:s + step], padding, g[s:s + step]) for x, padding, g in state]
                if gram:
                    n2[s:s + step] = (self._gram32_norms if float32 else self._gram64_norms)(m, chunk, by_inputs)
                else:
                    form = tap_major if state.tap_major else functools.partial(self._weight_grad,
                                                                               examples=len(chunk[0][2]))
                    w = form(m, *chunk[0]).view(len(chunk[0][2]), -1)  # L terms per entry either way
                    for x, padding, g in chunk[1:]:  # a reused layer: its calls' gradients add up (w is fresh)
                        w.add_(form(m, x, padding, g).view(len(g), -1))
                    if state.formed is not None:
                        state.formed.append(w)
                    b = squares(w)
                    n2[s:s + step] = b.n2
                    rel, floor = b.rel + (0.0 if state.formed is None else gamma(batch + 2)), b.floor
        if "bias" in names:
            b = squares(sum(g.flatten(2).sum(-1) for _, _, g in state))
            n2 += b.n2
            rel, floor = max(rel, b.rel), floor + b.floor
            err += gn * (math.sqrt(lengths) * (gamma(lengths + 1) + kernel) * (1 + g_rel) * (1 + 4 * U64))
        slack = UNDERFLOW * lengths * math.sqrt(sum(getattr(m, k).numel() for k in names))
        return Bound(n2, rel, err, slack, floor)

    def add_clipped(self, m, state, factor, view_of):
        names = trainable(m)
        dtype = view_of[id(getattr(m, names[0]))].dtype
        c = per_call(max(math.prod(g.shape[2:]) for _, _, g in state))
        formed = getattr(state, "formed", None)  # None: re-prepared (rows zeroed for the float64 route): the kernel
        if formed is not None and "weight" in names:  # the bound covers both: the formed norms' rel, the kernel's err
            s = 0  # one product per chunk, each added: a term sees at most its chunk's adds + the chunks' <= n roundings
            for w in formed:
                total = weighted_sum(w, factor[s:s + len(w)].to(w.dtype))
                total = total.view(m.out_channels, *m.kernel_size, -1).movedim(-1, 1) if state.tap_major \
                    else total.view(m.weight.shape)
                view_of[id(m.weight)].add_(total)
                s += len(w)
        for x, padding, g in state:
            for s in range(0, len(g), c):
                scaled = (g[s:s + c] * factor[s:s + c].view(-1, *[1] * (g.dim() - 1))).to(dtype)
                if "weight" in names and formed is None:
                    terms = len(scaled) * math.prod(g.shape[2:])  # the same sums either way: one bound
                    kernel = self._sum_by_patches if m.weight.numel() >= self.PATCH_SUM_IF * terms else self._weight_grad
                    view_of[id(m.weight)].add_(kernel(m, x[s:s + c].to(dtype), padding, scaled))
                if "bias" in names:
                    view_of[id(m.bias)].add_(scaled.flatten(2).sum((0, 2)))

    def sample(self, m, calls, k, absolute=False):
        out: dict[str, torch.Tensor] = {}
        for x, padding, g in self.prepare(m, [(a[k:k + 1], g[k:k + 1]) for a, g in calls], 1):
            u = self._patches(m, x, padding)[0]  # (groups, C_in k / groups, L): an independent route to the gradient
            gk = g[0].reshape(m.groups, -1, u.shape[-1])
            u, gk = abs_if(u, absolute), abs_if(gk, absolute)
            grads = {"weight": (gk @ u.transpose(-1, -2)).reshape(m.weight.shape), "bias": gk.sum(-1).reshape(-1)}
            for name in trainable(m):
                out[name] = out[name] + grads[name] if name in out else grads[name]
        return out
