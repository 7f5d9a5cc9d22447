"""Book-keeping's lean path for the common case: every trainable layer an ``nn.Linear`` called once on float32 rows
(n, d) (the default MLP). A step of that model costs a few hundred microseconds, so the generic path's bookkeeping
(per-layer Bound objects, routes, joins, ties, stacked small tensors, the margins recomputed every step) weighs as
much as its kernels. Here the margins are computed once per (layers, their trainable parameters and widths, public
batch bound, C), and each step runs only
the tensor operations: per layer :meth:`LinearRule.row_norms`, their float32 sum, :func:`bound.scaled` and
:meth:`LinearRule._add_clipped_rows`.

Privacy: this is the generic path's own computation, not a second one. The same functions, on the same tensors, in
the same order (the layers as they arrived, their squared-norm bounds summed into the first in float32, then
``rsqrt``, ``mul`` by c, ``clamp``), with the same public constants (:meth:`LinearRule.row_terms` and
:func:`bound.clip_scale`, computed from the shapes, the public micro-batch bound and C, never from values), so every
factor and every clipped sum is bit for bit the generic path's, and its rounding argument (LinearRule.bound's rows
route and :func:`bound.clip_factors`) is this one's. Where that argument sends an example elsewhere (a bound that is
not finite, a factor below ``TINY_FACTOR``: :func:`bound.within`), or where a call is not the common case (a layer
called twice, a sequence, another dtype: decided from shapes and dtypes alone), :meth:`add` returns None and the
caller runs the generic path on the same inputs, from the start.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.privacy.clipping.bound import clip_scale, scaled, within
from workbench.privacy.clipping.layers import LinearRule, trainable


class LinearRows:
    """The lean path for ``layers`` (their rules all :class:`LinearRule`, each an ``nn.Linear`` exactly: no tied
    weights, which need an Embedding; raw parameters are the caller's to exclude)."""

    def __init__(self):
        self._key: tuple | None = None  # (layers as they arrived, their trainable names and widths, batch bound, C):
        # what _terms and _c were made for
        self._terms: list[tuple] = []  # per layer: (names, (alpha, beta)) of LinearRule.row_terms
        self._c = 0.0

    @staticmethod
    def fits(layers: list[nn.Module], rules: dict) -> bool:
        """Whether the lean path may serve these layers (public: their types)."""
        return bool(layers) and all(type(m) is nn.Linear and type(rules[m]) is LinearRule for m in layers)

    def add(self, arrived: dict, batch: int, clip: float, view_of: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """Add sum_i f_i grad_i into ``view_of`` and return the factors f; None (nothing added): the generic path."""
        if next(iter(view_of.values())).dtype is not torch.float32:  # the buffer's precision is the rows route's
            return None
        rows = []
        for formed, calls in arrived.values():
            if formed is not None or len(calls) != 1:
                return None
            a, g = calls[0]
            if a.dim() != 2 or a.dtype is not torch.float32 or g.dtype is not torch.float32:
                return None
            rows.append((a, g))
        # what the margins depend on, read every step as the generic path reads it: the trainable parameters (one
        # may be frozen after construction) and the widths of a and g (a layer's weight may be replaced)
        names = tuple(tuple(trainable(m)) for m in arrived)
        key = (*arrived, names, tuple((a.shape[1], g.shape[1]) for a, g in rows), batch, clip)
        if key != self._key:
            self._terms, parts = [], []
            for m, names_m, (a, g) in zip(arrived, names, rows):
                terms, b = LinearRule.row_terms(m, list(names_m), a.shape[1], g.shape[1], batch)
                self._terms.append((list(names_m), terms))
                parts.append(b)
            self._c, self._key = clip_scale(parts, clip, torch.float32), key
        n2 = None
        for (_, terms), (a, g) in zip(self._terms, rows):
            t = LinearRule.row_norms(a, g, *terms)
            n2 = t if n2 is None else n2.add_(t)
        factor = scaled(n2, self._c)
        if not within(factor):
            return None
        for m, (names_m, _), (a, g) in zip(arrived, self._terms, rows):
            LinearRule._add_clipped_rows(m, names_m, a, g, factor, view_of)
        return factor
