"""nn.Embedding's rule: per (example, index) sums of g rows, no dense per-sample gradient."""

from __future__ import annotations

import math

import torch

from workbench.privacy.clipping.bound import U64, Bound, example_norms, gamma
from workbench.privacy.clipping.layers.common import Calls, abs_if, cat, kernel_depth, per_call, precise


class EmbeddingRule:
    """nn.Embedding: example i's gradient has one row per distinct index it looks up, the sum of its g rows for
    that index. Norms come from summing rows per (example, index) pair -- collisions within an example add up,
    across examples they do not -- with no dense (n, V, d) tensor; the clipped sum is one index_add_."""

    @staticmethod
    def keeps(m, a, g) -> bool:
        return True

    @staticmethod
    def prepare(m, calls: Calls, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = cat([a.reshape(n, -1) for a, _ in calls], 1)
        g = cat([precise(g).reshape(n, -1, g.shape[-1]) for _, g in calls], 1)
        if m.padding_idx is not None:  # the padding row gets no gradient
            g = g * (idx != m.padding_idx).unsqueeze(-1).to(g.dtype)
        return idx, g

    def bound(self, m, state, n, batch):
        idx, g = state
        rows = torch.arange(n, device=idx.device).unsqueeze(1) * m.num_embeddings + idx
        pairs, which = torch.unique(rows.flatten(), return_inverse=True)
        summed = torch.zeros(len(pairs), g.shape[-1], device=g.device, dtype=torch.float64)
        summed.index_add_(0, which, g.reshape(-1, g.shape[-1]).double())  # float64: repeats may cancel
        n2 = torch.zeros(n, device=g.device, dtype=torch.float64).index_add_(
            0, torch.div(pairs, m.num_embeddings, rounding_mode="floor"), torch.linalg.vecdot(summed, summed))
        # the float64 sums of an example's repeats (gamma64_T S), the index_add_ over the n T rows (gamma_{nT+2} S);
        # no product after the scaling: subnormal rounding moves each entry by at most 2^-149
        steps = g.shape[1]
        magnitude, g_rel = example_norms(g)  # sum_t ||g_t|| <= sqrt(T) ||g||_F
        magnitude.mul_(math.sqrt(steps))
        scale = (1 + g_rel) * (1 + 4 * U64)
        return Bound(n2, 0.0, magnitude.mul_((gamma(steps, U64) + gamma(kernel_depth(batch, steps))) * scale),
                     2.0 ** -149 * math.sqrt(g[0].numel()))

    def add_clipped(self, m, state, factor, view_of):
        idx, g = state
        c, view = per_call(g.shape[1]), view_of[id(m.weight)]
        for s in range(0, len(g), c):
            scaled = (g[s:s + c] * factor[s:s + c].view(-1, 1, 1)).to(view.dtype).reshape(-1, g.shape[-1])
            ids = idx[s:s + c].flatten()
            if len(g) <= c:  # one chunk: its rows added into the buffer, at most c T + 1 roundings a term
                view.index_add_(0, ids, scaled)
                continue
            # several: each chunk summed apart first, then added once, as kernel_depth counts (a row added straight
            # into the buffer would be rounded again by every later chunk's rows for its id)
            rows, where = torch.unique(ids, return_inverse=True)
            view.index_add_(0, rows, torch.zeros(len(rows), scaled.shape[1], dtype=scaled.dtype,
                                                 device=scaled.device).index_add_(0, where, scaled))

    def sample(self, m, calls, k, absolute=False):
        idx, g = self.prepare(m, [(a[k:k + 1], g[k:k + 1]) for a, g in calls], 1)
        out = torch.zeros(m.weight.shape, device=g.device, dtype=g.dtype)
        return {"weight": out.index_add_(0, idx.flatten(), abs_if(g[0], absolute))}
