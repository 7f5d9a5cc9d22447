"""Tied weights on book-keeping: an nn.Embedding and an nn.Linear that share one weight (V, d), as GPT-2, nanoGPT
and T5 tie the token embedding to the output projection (BERT's masked-LM head also shares its bias with a
second module: refused, as any other sharing).

Example i's gradient of the shared weight is the sum of both layers' gradients, E_i + L_i, so its squared norm is
||E_i||^2 + ||L_i||^2 + 2 <E_i, L_i>: per-layer norms would split it (and miss the cross term). Both are sums of
rank-one terms over positions: E_i = sum_t e_{x_t} u_t^T (the embedding's ids x_t, its output gradients u_t) and
L_i = sum_s g_s a_s^T (the head's output gradients g_s over V, its inputs a_s), so the pair is one Linear over T + S
positions whose "g" side is one-hot e_{x_t} or g_s and whose "a" side is u_t or a_s; its squared norm is the Gram sum
sum_{p,p'} <A_p, A_p'> <G_p, G_p'>, taken here blockwise in float64 without forming a one-hot or an (n, V, d) tensor:
  EE = sum_{t,t'} [x_t = x_t'] <u_t, u_t'>        (the embedding rule's per-(example, id) row sums),
  LL = sum_{s,s'} <a_s, a_s'> <g_s, g_s'>          (the Linear rule's Gram route),
  EL = sum_{t,s} g_s[x_t] <u_t, a_s>               (the cross term).
Each layer still adds its own clipped sum by its own kernel (an index_add_ and a matmul), into the one buffer view.

The bound (the argument of :mod:`workbench.privacy.clipping.bound`): every term of the three sums is a product of two
float64 inner products of at most max(d, V) + T roundings (one-hot products are exact) on exact float64 copies of the
float32 inputs, and the sums run over at most 3 (T + S)^2 terms, each at most ||A_p|| ||G_p|| ||A_p'|| ||G_p'|| in
size, so the computed squared norm is within gamma64_D M^2 of the exact, D = d + V + T + 3 (T + S)^2 + 4 and
M = M_E + M_L (M_E = sum_t ||u_t|| <= sqrt(T) ||u||_F, M_L = sum_s ||g_s|| ||a_s|| <= ||g||_F ||a||_F): its square root
is within sqrt(gamma64_D) M of the exact norm. The two kernels add within gamma_K M_E and gamma_K' M_L of the exact
E_i and L_i (K, K' their depths as for each layer alone, the embedding's plus the head's chunk results added after
it into the same entries). A trainable bias on the head is a disjoint part: its
per-example sums over S are float32 (within gamma_{S+1} sqrt(S) ||g||_F), squared as formed tensors are.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from workbench.privacy.clipping.bound import U64, UNDERFLOW, Bound, example_norms, gamma, squares
from workbench.privacy.clipping.layers import EmbeddingRule, LinearRule, kernel_depth, per_call, trainable

CHUNK = 2 ** 22  # float64 entries of one chunk of examples' head gradients (the Gram work is done per chunk)


def tied_pairs(layers: list[nn.Module]) -> tuple[list[tuple[nn.Embedding, nn.Linear]], str | None]:
    """The (Embedding, Linear) pairs among ``layers`` that share their trainable weight, and why sharing that is not
    such a pair cannot be clipped (None: it can): any other parameter seen from two layers, or one seen from more."""
    users: dict[int, list[nn.Module]] = {}
    for m in layers:
        for p in m.parameters(recurse=False):
            if p.requires_grad:
                users.setdefault(id(p), []).append(m)
    pairs = []
    for ms in users.values():
        if len(ms) == 1:
            continue
        kinds = sorted(ms, key=lambda m: not isinstance(m, nn.Embedding))
        if len(ms) == 2 and type(kinds[0]) is nn.Embedding and type(kinds[1]) is nn.Linear \
                and kinds[0].weight is kinds[1].weight:
            pairs.append((kinds[0], kinds[1]))
        else:
            return [], "cannot clip a parameter shared between layers other than an Embedding and a Linear " \
                       "(tied weights)"
    return pairs, None


def tie(kept: list, tied: dict) -> list:
    """Book-keeping's kept calls (rule, layer, calls) with each tied pair whose two layers both ran as one unit
    (``tied``: layer -> its pair); a pair of which one layer did not reach the loss is that layer's gradient alone,
    which its own rule clips exactly."""
    if not tied:
        return kept
    calls_of = {m: calls for _, m, calls in kept if m in tied}
    out, done = [], set()
    for unit in kept:
        pair = tied.get(unit[1])
        if pair is None or not (pair.embedding in calls_of and pair.linear in calls_of):
            out.append(unit)
        elif pair not in done:
            done.add(pair)
            out.append((TIED, pair, calls_of[pair.embedding] + calls_of[pair.linear]))
    return out


class TiedPair:
    """The pair as one book-keeping unit (made once, reused across steps)."""

    def __init__(self, embedding: nn.Embedding, linear: nn.Linear):
        self.embedding, self.linear = embedding, linear


class TiedRule:
    """Kept calls of both layers, one list (the embedding's told by their integer ids); the norms of the module
    docstring."""

    @staticmethod
    def prepare(pair: TiedPair, calls, n: int):
        emb = [(a, g) for a, g in calls if not a.is_floating_point()]  # the embedding's ids; the head's a is floating
        lin = [(a, g) for a, g in calls if a.is_floating_point()]
        return EmbeddingRule.prepare(pair.embedding, emb, n), LinearRule.prepare(pair.linear, lin, n)

    @staticmethod
    def _norms(idx, u, a, g) -> torch.Tensor:
        """(n,) float64 squared norms of E_i + L_i (module docstring), in chunks of examples."""
        n, c = len(a), max(1, CHUNK // max(1, g.shape[1] * g.shape[2]))
        out = []
        for s in range(0, n, c):
            x, uu, aa, gg = (t[s:s + c] for t in (idx, u, a, g))
            uu, aa, gg = uu.double(), aa.double(), gg.double()
            same = x.unsqueeze(2) == x.unsqueeze(1)  # [x_t = x_t']
            ee = (uu @ uu.transpose(1, 2)).mul_(same).sum((1, 2))
            ll = (aa @ aa.transpose(1, 2)).mul_(gg @ gg.transpose(1, 2)).sum((1, 2))
            picked = gg.gather(2, x.unsqueeze(1).expand(-1, gg.shape[1], -1))  # (c, S, T): g_s[x_t]
            el = (uu @ aa.transpose(1, 2)).mul_(picked.transpose(1, 2)).sum((1, 2))
            out.append(ee.add_(ll).add_(el, alpha=2.0))
        return torch.cat(out).clamp_(min=0)

    def bound(self, pair: TiedPair, state, n: int, batch: int) -> Bound:
        (idx, u), (a, g) = state
        a, g = a.reshape(n, -1, a.shape[-1]), g.reshape(n, -1, g.shape[-1])
        steps_e, steps_l = u.shape[1], g.shape[1]
        n2 = self._norms(idx, u, a, g)
        (un, u_rel), (gn, g_rel), (an, a_rel) = example_norms(u), example_norms(g), example_norms(a)
        m_e = un.mul_(math.sqrt(steps_e))
        bias = "bias" in trainable(pair.linear)
        m_l = gn.mul_(an.add_(math.sqrt(steps_l)) if bias else an)
        d, v = a.shape[2], g.shape[2]
        gram = math.sqrt(gamma(d + v + steps_e + 3 * (steps_e + steps_l) ** 2 + 4, U64))
        # the embedding's entries are rounded again by each of the head's chunk results added after them
        depth_e = kernel_depth(batch, steps_e) + math.ceil(batch / per_call(steps_l))
        err = (m_e * (gram + gamma(depth_e))).add_(
            m_l * (gram + gamma(kernel_depth(batch, steps_l)) + (gamma(steps_l + 1) if bias else 0.0)))
        scale = (1 + max(u_rel, g_rel)) * (1 + a_rel) * (1 + 4 * U64)
        # subnormal rounding of the scaled values: the embedding's (as EmbeddingRule), the head's (as LinearRule)
        slack = 2.0 ** -149 * math.sqrt(steps_e * u.shape[2]) + \
            UNDERFLOW * steps_l * math.sqrt(sum(getattr(pair.linear, k).numel() for k in trainable(pair.linear)))
        if not bias:
            return Bound(n2, 0.0, err.mul_(scale), slack)
        b = squares(g.sum(1))
        return Bound(n2.add_(b.n2), b.rel, err.mul_(scale), slack, b.floor)

    @staticmethod
    def add_clipped(pair: TiedPair, state, factor, view_of) -> None:
        emb, lin = state
        EmbeddingRule().add_clipped(pair.embedding, emb, factor, view_of)
        LinearRule().add_clipped(pair.linear, lin, factor, view_of)


TIED = TiedRule()
