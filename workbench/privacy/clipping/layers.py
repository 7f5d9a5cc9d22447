"""Book-keeping's per-layer rules: from a layer's input ``a`` and output gradient ``g`` (batch first), each call's
part of the per-sample squared gradient norms and of the clipped sum.

Book-keeping hands a rule each call's (a, g) during the backward, as g arrives. The rule takes one of two routes:
- per-sample gradients (``keeps`` false): ``per_sample(m, a, g)`` forms them at once, (n, *shape) per parameter, and
  a and g are let go; the norms are theirs, the clipped sum one matrix-vector product. Taken where they are no larger
  than a and g (convolutions, normalisation affine parameters; Linear sequences up to ``LinearRule.FORM_IF`` times
  larger): memory near a non-private step's, and the clipped sum costs no second weight-gradient kernel.
- kept calls (``keeps`` true): (a, g) are held until the clip factors are known, then
  ``prepare(m, calls, n)``              what the two steps below share (e.g. the calls joined), computed once;
  ``bound(m, state, n, batch)``         a :class:`~workbench.privacy.clipping.bound.Bound` per example: a certified upper
                                        bound on the norm of what ``add_clipped`` will add for it (the argument is in
                                        :mod:`workbench.privacy.clipping.bound`), never a float estimate of it;
  ``add_clipped(m, state, f, view_of)`` sum_i f_i grad_i into each trainable parameter's buffer view.
  Taken where per-sample gradients would be larger (one row per example through a Linear, embeddings, wide layers).
``sample(m, calls, k, absolute)`` is the pre-run check's independent route: example k's own gradient per parameter name
(``absolute``: the same sum over |terms|, the check's rounding scale).
Only parameters with ``requires_grad`` are clipped (a frozen bias or base weight is skipped). Rules work in float32 at
least: under bf16/fp16 autocast a and g arrive in half precision, and norms, clip factors and the clipped sum must not
round there; the sum is cast to the buffer's dtype only when added.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from workbench.privacy.clipping.bound import (SUBNORMAL, UNDERFLOW, U32, U64, Bound, example_norms, gamma,
                                              diagonal_norms, gram32_margin, squares)

Calls = list[tuple[torch.Tensor, torch.Tensor]]  # (layer input a, gradient g of its output) per call


def trainable(m: nn.Module) -> list[str]:
    return [name for name, p in m._parameters.items() if p is not None and p.requires_grad]  # no generator: per call


_WIDE = (torch.float32, torch.float64)


def _precise(t: torch.Tensor) -> torch.Tensor:
    """A layer input or output gradient in float32 at least (no-op in float32/64; integer ids kept)."""
    if t.dtype in _WIDE or not t.is_floating_point():
        return t
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _gram64(t: torch.Tensor) -> torch.Tensor:
    """(n, T, T) float64 Gram matrices of (n, T, d) ``t`` from an exact float64 copy, freed on return: the copies of a
    and g are never held together (a step's peak memory)."""
    t = t.double()
    return t @ t.mT


def weighted_sum(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """sum_i factor_i t_i for per-sample gradients t (n, *shape), one matrix-vector product (t may be a transposed
    view, as the Linear rule forms it)."""
    if t.dim() == 3 and not t.is_contiguous() and t.transpose(1, 2).is_contiguous():
        return torch.mv(t.transpose(1, 2).reshape(len(t), -1).t(), factor).view(t.shape[2], t.shape[1]).t()
    return torch.mv(t.reshape(len(t), -1).t(), factor).view(t.shape[1:])


def _position_sums(g: torch.Tensor) -> torch.Tensor:
    """sum_t g_t of (n, T, d), (n, d): on wide layers a matmul with ones (measured 3.3x faster than g.sum(1) at
    d = 1536, T = 128; 1.1-1.2x slower at d <= 384), the same sums of T terms as rounded."""
    if g.shape[-1] <= 512:
        return g.sum(1)
    return torch.matmul(g.new_ones(1, g.shape[1]), g).squeeze(1)


def _cat(ts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts, dim)  # cat copies even one tensor


def _abs(t: torch.Tensor, absolute: bool) -> torch.Tensor:
    return t.abs() if absolute else t


def _per_example(t: torch.Tensor) -> int:
    return t.numel() // max(1, len(t))


PER_SAMPLE_IF = 1.0  # per-sample gradients formed where they take at most this many times the memory of a and g


def smaller_kept(m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether holding a and g costs clearly less memory than m's trainable per-sample gradients (forming those saves
    the clipped sum's weight-gradient kernel: within a margin they are worth their memory)."""
    return PER_SAMPLE_IF * (_per_example(a) + _per_example(g)) < sum(getattr(m, name).numel() for name in trainable(m))


KERNEL_ROWS = 2048  # the most (example, position) terms one clipped-sum kernel call reduces over: chunks of examples
# keep its rounding margin gamma_K small and public (the same whatever number of examples was drawn)


def per_call(positions: int) -> int:
    """Examples per clipped-sum kernel call for layers whose examples have ``positions`` terms each."""
    return max(1, KERNEL_ROWS // max(1, positions))


def kernel_depth(batch: int, positions: int, calls: int = 1) -> int:
    """The most roundings a term of the clipped sum goes through: its chunk's kernel, then the adds of the chunk
    results (of every call) into the buffer view, for up to ``batch`` examples (public: max_physical_batch_size)."""
    c = per_call(positions)
    return min(batch, c) * positions + calls * math.ceil(batch / c) + 2


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


class LinearRule:
    """nn.Linear on (n, d) or (n, ..., d) inputs. One row per example: ||g_i a_i^T||^2 = ||a_i||^2 ||g_i||^2, the calls
    kept, the clipped sum one matmul. Sequences choose by cost (the mixed ghost-norm rule of Bu et al., 2023), in units
    of the non-private weight-gradient matmul's T d_in d_out multiply-adds per example:
    - formed: the per-sample gradients sum_t g_t a_t^T (one batched matmul, ``FORM_COST`` per unit: its inner
      dimension is only T), taken during the backward where at most ``FORM_IF`` times the memory of a and g; the
      clipped sum is then one matrix-vector product;
    - kept with Gram norms: sum_{t,t'} <a_t,a_t'> <g_t,g_t'> (T^2 (d_in + d_out) multiply-adds, ``GRAM_COST`` each,
      :meth:`_gram`), then the clipped sum as a second weight-gradient matmul (1 unit);
    - kept with formed norms (where the Gram matrices cost more than forming): both, the dearest.
    Kept wins over formed where GRAM_COST T (d_in + d_out) < (FORM_COST - 1) d_in d_out. Measured (one thread, CPU
    time, n = 16, float32 Gram as :meth:`_gram`; ms): 384x1536 at T = 128: weight-gradient mm 33, formed 58, Gram 16;
    T = 256: 59, 86, 66; T = 512: 140, 161, 238; 768x3072 at T = 128: 105, 224, 36; 256x1024 at T = 64: 7.7, 13, 4.2;
    384x384 at T = 128: 8.6, 8.7, 5.8 (FORM_COST 1.15-2.1, GRAM_COST 1.0-1.7 per unit)."""

    FORM_COST = 1.65  # formed per-sample gradients per unit (batched matmul over T only: 1.15x at T = 512, 2.1x at 128)
    GRAM_COST = 1.3  # the float32 Gram matrices per multiply-add, relative to the weight-gradient matmul's
    FORM_IF = 1.25  # sequences form per-sample gradients during the backward where they take at most 1.25x the memory
    # of a and g (either is held to the end of the backward): their clipped sum is then one matrix-vector product, not a
    # second weight-gradient kernel (MiniLM's FFN at T = 256, 1.2x: the step 10 % faster; gpt's 64-wide attention,
    # 1.02x). At 2x the tiny BERT's and gpt's FFN formed too (1.47x, 1.6x): peak step memory 1.30x and 1.68x of
    # non-private, now 1.24x and 1.31x, for -6 % / +2.5 % of their step speed; vit's (3.3x) stay kept
    TIGHT = 2.0 ** -8  # the float32 Gram's rounding margin accepted up to this share of the squared norm (<= 0.2 % on
    # the norm, as loose as the kernels' own margins); examples past it are recomputed in float64 (:meth:`_gram`)
    GRAM64_IF = 2 ** 16  # Gram matrices of at most this many multiply-adds per example, T^2 (d_in + d_out), are taken
    # in float64 with the bias folded in (:meth:`_bound64`): there per-matrix overhead, not the products, is the cost
    # (vit's 32 -> 96 at T = 5: 3,200; a float64 bmm measured no slower than float32's), and the float32 route's margin,
    # loose-example mask and separate bias sum are ~30 small ops a layer; MiniLM's 384x1536 at T = 128 (31M) stays float32

    @classmethod
    def keeps(cls, m, a, g) -> bool:
        if a.dim() == 2:
            return True
        weights = sum(getattr(m, name).numel() for name in trainable(m))
        if cls.FORM_IF * (_per_example(a) + _per_example(g)) < weights:
            return True  # forming would take too much memory
        t, d_in, d_out = _per_example(a) // a.shape[-1], a.shape[-1], g.shape[-1]
        return "weight" in trainable(m) and cls.gram_pays(t, d_in, d_out, cls.FORM_COST - 1.0)

    @classmethod
    def gram_pays(cls, t: int, d_in: int, d_out: int, against: float) -> bool:
        """Whether the Gram matrices of a (T, d_in) input and (T, d_out) output gradient cost less than ``against``
        units of T d_in d_out (see the class docstring)."""
        return cls.GRAM_COST * t * (d_in + d_out) < against * d_in * d_out

    @staticmethod
    def per_sample(m, a, g):
        n = len(a)
        a, g = _precise(a).reshape(n, -1, a.shape[-1]), _precise(g).reshape(n, -1, g.shape[-1])
        names = trainable(m)
        out = {"weight": LinearRule._weights(a, g)} if "weight" in names else {}
        if "bias" in names:
            out["bias"] = _position_sums(g)
        return out

    @staticmethod
    def _weights(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """(n, d_out, d_in) per-sample weight gradients sum_t g_t a_t^T of (n, T, d) inputs, one batched matmul with
        the narrower side as rows (measured up to 5x faster on small matrices); then a transposed view."""
        if a.shape[-1] <= g.shape[-1]:
            return torch.bmm(a.transpose(1, 2), g).transpose(1, 2)
        return torch.bmm(g.transpose(1, 2), a)

    def use_gram(self, a: torch.Tensor, g: torch.Tensor) -> bool:
        """Kept sequences (n, T, d_in), (n, T, d_out): per-sample weight norms by the Gram route where its matrices
        cost less than forming the per-sample gradients (else formed)."""
        return self.gram_pays(a.shape[1], a.shape[2], g.shape[2], self.FORM_COST)

    @classmethod
    def _gram(cls, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                               torch.Tensor]:
        """(n,) float64 upper bounds on the squared norms of sum_t g_t a_t^T, the mask of examples whose bound came
        from float64 Gram matrices (None: none did), and (n, T) upper bounds on the position norms ||a_t||, ||g_t||.
        The Gram matrices A = a a^T, G = g g^T in float32, their products (exact in float64) summed in float64: within
        a margin M of the exact squared norm (:func:`~workbench.privacy.clipping.bound.gram32_margin`, from the
        position norms, read off the Gram matrices' diagonals: :func:`~workbench.privacy.clipping.bound.
        diagonal_norms`), so max(sum, 0) + M is an upper bound. Where M is
        more than ``TIGHT`` of it (terms that cancel across positions) the example's Gram is recomputed from float64
        copies of a and g (exact), its sum within gamma64_{d_in+d_out+T^2+2} S^2 of the exact, S = sum_t ||g_t||
        ||a_t||; that margin goes into the caller's err, as before, so such an example is judged by clip_factors'
        ill-conditioning test on its float64 norm."""
        ga, gg = a @ a.transpose(1, 2), g @ g.transpose(1, 2)
        an, gn = diagonal_norms(ga, a.shape[2]), diagonal_norms(gg, g.shape[2])
        n2 = ga.double().mul_(gg.double()).sum((1, 2))
        margin = gram32_margin(an, gn, a.shape[2], g.shape[2])
        bound = n2.clamp(min=0).add_(margin).mul_(1.0 + 4 * U64)  # the two float64 roundings here, rounded up
        loose = ~(margin <= cls.TIGHT * n2)  # NaN (inf - inf) included
        if not bool(loose.any()):
            return bound, None, an, gn
        rows = loose.nonzero().flatten()
        a64, g64 = a[rows].double(), g[rows].double()
        bound[rows] = (a64 @ a64.transpose(1, 2)).mul_(g64 @ g64.transpose(1, 2)).sum((1, 2)).clamp_(min=0)
        return bound, loose, an, gn

    @staticmethod
    def prepare(m, calls: Calls, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if len(calls) == 1 and calls[0][0].dim() == 2:
            return tuple(_precise(t) for t in calls[0])
        return tuple(_cat([_precise(t).reshape(n, -1, t.shape[-1]) for t in ts], 1) for ts in zip(*calls))

    def bound(self, m, state, n, batch):
        a, g = state
        names = trainable(m)
        if a.dim() == 2:  # ||g_i a_i^T||^2 = ||a_i||^2 ||g_i||^2 (+ ||g_i||^2 with a bias), one product per entry
            terms, b = self.row_terms(m, names, a.shape[1], g.shape[1], batch)
            return b._replace(n2=self.row_norms(a, g, *terms))
        # sequences: per-sample gradients formed in float32 (sum over T: within gamma_T S of the exact) or the Gram
        # route (float32 Gram matrices: their margin in n2; or float64: its squared norm within gamma64_D S^2, so its
        # norm within sqrt(gamma64_D) S), the clipped sum one matmul per chunk of examples (within gamma_depth S),
        # S = sum_t ||g_t|| (||a_t|| + 1 with a bias): from the position norms the Gram route takes anyway, else
        # <= ||g||_F (||a||_F + sqrt(T)) by Cauchy-Schwarz (two passes, no per-position tensors)
        steps = a.shape[1]
        gram = "weight" in names and self.use_gram(a, g)
        if gram and steps * steps * (a.shape[2] + g.shape[2]) <= self.GRAM64_IF:
            return self._bound64(m, a, g, names, batch)
        formed = gamma(steps + 1)  # the bias's sum over T is formed in float32 on both routes
        in64 = None  # the examples whose Gram is float64's (their margin is err's, not n2's)
        if gram:
            n2w, in64, an, gn = self._gram(a, g)
            w, g_rel, a_rel = Bound(n2w), 0.0, 0.0  # the position norms are upper bounds already
        else:
            (gn, g_rel), (an, a_rel) = example_norms(g), example_norms(a)
            w = squares(self._weights(a, g)) if "weight" in names else None
        b = squares(_position_sums(g)) if "bias" in names else None
        if w is None:
            n2, rel, floor, magnitude = b.n2, b.rel, b.floor, gn.mul_(math.sqrt(steps))
        elif b is None:
            n2, rel, floor = w.n2, w.rel, w.floor
            magnitude = torch.linalg.vecdot(gn, an) if gram else gn.mul_(an)
        else:
            n2, rel, floor = w.n2.double().add_(b.n2), max(w.rel, b.rel), w.floor + b.floor
            magnitude = torch.linalg.vecdot(gn, an.add_(1.0)) if gram else gn.mul_(an.add_(math.sqrt(steps)))
        if gram:  # the float64 sum over positions, rounded up
            magnitude.mul_(1.0 + gamma(steps + 1, U64))
        scale = (formed + gamma(kernel_depth(batch, steps))) * (1 + g_rel) * (1 + a_rel) * (1 + 4 * U64)
        err = magnitude * scale
        if in64 is not None:
            g64 = math.sqrt(gamma(a.shape[2] + g.shape[2] + steps ** 2 + 2, U64))
            err += magnitude.mul_(in64.to(magnitude.dtype)).mul_(g64 * (1 + g_rel) * (1 + a_rel) * (1 + 4 * U64))
        return Bound(n2, rel, err,
                     UNDERFLOW * steps * math.sqrt(sum(getattr(m, k).numel() for k in names)), floor)

    @staticmethod
    def row_terms(m, names: list[str], d_in: int, d_out: int, batch: int) -> tuple[tuple, Bound]:
        """The rows route's public constants (shapes only): what :meth:`row_norms` adds to ||a_i||^2 (None: no
        weight) and to ||g_i||^2, and the Bound's margins (its n2 left None)."""
        if "weight" not in names:
            return (None, d_out * SUBNORMAL), Bound(None, gamma(d_out + 2) / 2 + gamma(kernel_depth(batch, 1)),
                                                    slack=UNDERFLOW * math.sqrt(d_out))
        # the squares' rounding (gamma_d each, halved on the norm), the add and product (3u), the matmul over n
        # rows and the add into the buffer (gamma_{n+2}: no cancellation within one example's rank-1 term)
        rel = (gamma(d_in + 2) + gamma(d_out + 2)) / 2 + 2 * U32 + gamma(kernel_depth(batch, 1))
        return ((1.0 if "bias" in names else 0.0) + d_in * SUBNORMAL, d_out * SUBNORMAL), Bound(
            None, rel, slack=UNDERFLOW * math.sqrt(m.weight.numel() + d_out),
            floor=2.0 ** -148)  # the float32 product of two tiny squares may round to 0

    @staticmethod
    def row_norms(a: torch.Tensor, g: torch.Tensor, alpha: float | None, beta: float) -> torch.Tensor:
        """(n,) float32 (||a_i||^2 + alpha) (||g_i||^2 + beta), or ||g_i||^2 + beta without a weight (alpha None):
        float32 squares within gamma_d, those lost below 2^-126 added back; inf (the float64 route) past 2^128."""
        gg = torch.linalg.vecdot(g, g)
        if alpha is None:
            return gg.add_(beta)
        aa = torch.linalg.vecdot(a, a).add_(alpha)
        return aa.mul_(gg.add_(beta))

    @staticmethod
    def _bound64(m, a: torch.Tensor, g: torch.Tensor, names: list[str], batch: int) -> Bound:
        """The Gram route on small matrices, in float64 from exact copies of a (n, T, d_in) and g (n, T, d_out), the
        bias folded into the weight: [W, b]'s input at position t is a'_t = [a_t, 1], so A' = A + 1 (each entry a
        float64 dot product of length d_in + 1, the 1 added last) and ||[W, b]'s gradient||^2 = sum_{t,t'} A'_tt'
        G_tt'. The T^2 products summed in float64 are within gamma64_D S^2 of the exact, D = d_in + 1 + d_out + T^2
        + 2 (each entry's dot product, the product, the sum), S = sum_t ||g_t|| ||a'_t||, so the norm is within
        sqrt(gamma64_D) S of it: in err beside the kernels' gamma_depth S (the bias's kernel sums g_t 1: the same
        S covers both). S from the diagonals (each within gamma64_{d+1} of the squared norm, from below at most),
        their product, square root and sum over T: rounded up by 1 + gamma64_{d_in + d_out + T + 8}. No float32
        rounding reaches n2 (float32's squares cannot underflow or overflow in float64): rel and floor are 0. An entry
        past 2^64 would not make these squares inf as float32's do, so such examples get n2 = inf here (the float64
        route), as on the other routes."""
        n, steps, d_in = a.shape
        d_out = g.shape[2]
        ga, gg = _gram64(a), _gram64(g)
        if "bias" in names:
            ga.add_(1.0)
            d_in += 1
        n2 = torch.linalg.vecdot(ga.view(n, -1), gg.view(n, -1)).clamp_(min=0)
        # bound.py's underflow argument needs every unscaled kernel operand below 2^64 (the float32 squares of the
        # other routes are inf past it): an example with a squared position norm past 2^127 takes the float64 route
        big = torch.maximum(ga.diagonal(dim1=1, dim2=2).amax(1), gg.diagonal(dim1=1, dim2=2).amax(1)) >= 2.0 ** 127
        n2.masked_fill_(big, math.inf)
        s = ga.diagonal(dim1=1, dim2=2).mul(gg.diagonal(dim1=1, dim2=2)).sqrt_().sum(1)
        up = 1.0 + gamma(d_in + d_out + steps + 8, U64)
        scale = (gamma(kernel_depth(batch, steps)) + math.sqrt(gamma(d_in + d_out + steps * steps + 2, U64))) * up
        return Bound(n2, err=s.mul_(scale * (1.0 + 2 * U64)),
                     slack=UNDERFLOW * steps * math.sqrt(sum(getattr(m, k).numel() for k in names)))

    def add_clipped(self, m, state, factor, view_of):
        a, g = state
        names = trainable(m)
        layers = m.layers if type(m) is JoinedLinears else (m,)  # each joined layer's own columns of the joined g
        dtype = view_of[id(layers[0]._parameters[names[0]])].dtype
        if a.dim() == 2 and a.dtype == g.dtype == dtype:  # one row per example, in the buffer's precision
            self._add_clipped_rows(m, names, a, g, factor, view_of)
            return
        c = per_call(_per_example(a) // a.shape[-1])
        narrow_a = a.shape[-1] < g.shape[-1]  # the factors scale the narrower of a and g: fewer products
        columns = _columns(layers)
        whole = len(columns) == 1  # one layer: its views directly, no column slices (a few us each on small layers)
        for s in range(0, len(a), c):  # out of place: autograd may hand one gradient tensor to two layers
            gs, as_, fs = (g, a, factor) if len(a) <= c else (g[s:s + c], a[s:s + c], factor[s:s + c])
            f = fs.view(-1, *[1] * (gs.dim() - 1))
            if "weight" in names:
                left, right = (gs, as_ * f) if narrow_a else (gs * f, as_)
                left, right = left.to(dtype).reshape(-1, gs.shape[-1]), right.to(dtype).reshape(-1, as_.shape[-1])
                if whole:
                    view_of[id(layers[0].weight)].addmm_(left.t(), right)
                else:
                    for layer, cols in columns:
                        view_of[id(layer.weight)].addmm_(left[:, cols].t(), right)
            if "bias" in names:  # sum_i f_i sum_t g_it: one matrix-vector product over the chunk's rows, one cast
                rows = gs.reshape(-1, gs.shape[-1])
                scale = fs.to(rows.dtype).repeat_interleave(len(rows) // len(gs))
                if whole and rows.dtype == dtype:  # into the buffer as _add_clipped_rows does: the same roundings
                    view_of[id(layers[0].bias)].addmv_(rows.t(), scale)
                    continue
                total = torch.mv(rows.t(), scale).to(dtype)
                for layer, cols in columns:
                    view_of[id(layer.bias)].add_(total if whole else total[cols])

    @staticmethod
    def _add_clipped_rows(m, names, a, g, factor, view_of):
        """sum_i f_i g_i a_i^T with the factors on the narrower of a and g (fewer products), sum_i f_i g_i one
        matrix-vector product; a and g are left as they are (autograd may hand one g to two layers)."""
        if factor.dtype != g.dtype:  # a float64 model's rows
            factor = factor.to(g.dtype)
        n, c = a.shape[0], per_call(1)
        weight = view_of[id(m._parameters["weight"])] if "weight" in names else None
        bias = view_of[id(m._parameters["bias"])] if "bias" in names else None
        for s in range(0, n, c):  # one chunk unless more than KERNEL_ROWS examples
            ac, gc, fc = (a, g, factor) if n <= c else (a[s:s + c], g[s:s + c], factor[s:s + c])
            if weight is not None:
                if ac.shape[1] < gc.shape[1]:
                    weight.addmm_(gc.t(), ac * fc.unsqueeze(1))
                else:
                    weight.addmm_((gc * fc.unsqueeze(1)).t(), ac)
            if bias is not None:
                bias.addmv_(gc.t(), fc)

    def sample(self, m, calls, k, absolute=False):
        a, g = (torch.cat([t[k].reshape(-1, t.shape[-1]) for t in ts], 0) for ts in zip(*calls))
        a, g = _abs(a, absolute), _abs(g, absolute)
        out = {"weight": g.t() @ a, "bias": g.sum(0)}
        return {name: out[name] for name in trainable(m)}


def _columns(layers) -> list[tuple[nn.Linear, slice]]:
    """Each layer's columns of its outputs set side by side."""
    if len(layers) == 1:
        return [(layers[0], slice(None))]
    out, start = [], 0
    for m in layers:
        out.append((m, slice(start, start + m.out_features)))
        start += m.out_features
    return out


class JoinedLinears:
    """nn.Linear layers that read one and the same input tensor, each once, in one forward (self-attention's q, k and
    v projections): to book-keeping one Linear whose outputs stand side by side. Example i's gradient of the stacked
    weights [W_1; W_2; ...] is [g_1i a_i^T; g_2i a_i^T; ...], exactly the layers' own gradients stacked, so its norm is
    their joint norm; the input's norms, Gram matrices and scaled copy are computed once, and each layer's clipped sum
    is its own matmul on its columns of the joined g (the same products, rounded alike, as the layer alone: the
    bound of the joined Linear covers each). Made once per set of layers and reused across steps."""

    def __init__(self, layers: tuple[nn.Linear, ...]):
        self.layers = layers
        self._parameters = {name: torch.empty(sum(getattr(m, name).shape[0] for m in layers),
                                              *getattr(layers[0], name).shape[1:], device="meta").requires_grad_()
                            for name in trainable(layers[0])}
        self.__dict__.update(self._parameters)


class JoinedLinearRule(LinearRule):
    """LinearRule on :class:`JoinedLinears`: its calls are the layers' own (one each, the same a), joined along the
    output features."""

    @staticmethod
    def prepare(m, calls: Calls, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = calls[0][0]
        return (_precise(a).reshape(n, -1, a.shape[-1]),
                torch.cat([_precise(g).reshape(n, -1, g.shape[-1]) for _, g in calls], -1))


class EmbeddingRule:
    """nn.Embedding: example i's gradient has one row per distinct index it looks up, the sum of its g rows for
    that index. Norms come from summing rows per (example, index) pair -- collisions within an example add up,
    across examples they do not -- with no dense (n, V, d) tensor; the clipped sum is one index_add_."""

    @staticmethod
    def keeps(m, a, g) -> bool:
        return True

    @staticmethod
    def prepare(m, calls: Calls, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = _cat([a.reshape(n, -1) for a, _ in calls], 1)
        g = _cat([_precise(g).reshape(n, -1, g.shape[-1]) for _, g in calls], 1)
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
        return {"weight": out.index_add_(0, idx.flatten(), _abs(g[0], absolute))}


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
        g = _precise(g)
        out = {}
        if "weight" in names:
            x, padding = self._padded(m, _precise(a))
            out["weight"] = self._per_example_weights(m, x, padding, g)
        if "bias" in names:
            out["bias"] = g.flatten(2).sum(2)
        return out

    def prepare(self, m, calls, n):
        return _ConvState((*self._padded(m, _precise(a)), _precise(g)) for a, g in calls)

    def stashes(self, m, state) -> bool:
        """Whether the per-sample weight gradients formed for the norms are kept for the clipped sum (``STASH_IF``)."""
        return m.weight.numel() <= self.STASH_IF * sum(_per_example(x) + _per_example(g) for x, _, g in state)

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
        u = _cat([self._patches_as(m, x, padding, torch.float64) for x, padding, _ in chunk], -1)
        g = _cat([g.double().reshape(len(g), m.groups, -1, math.prod(g.shape[2:])) for _, _, g in chunk], -1)
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
            u = _cat([self._patches_as(m, x, padding, torch.float32) for x, padding, _ in chunk], -1)
            g = _cat([g.reshape(len(g), 1, -1, math.prod(g.shape[2:])) for _, _, g in chunk], -1)
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
            u, gk = _abs(u, absolute), _abs(gk, absolute)
            grads = {"weight": (gk @ u.transpose(-1, -2)).reshape(m.weight.shape), "bias": gk.sum(-1).reshape(-1)}
            for name in trainable(m):
                out[name] = out[name] + grads[name] if name in out else grads[name]
        return out


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
        return formed > self.SMALL_FORMED and self.FORM_IF * (_per_example(a) + _per_example(g)) < formed

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
        g = _precise(g).reshape(n, g.shape[1], -1)  # (n, C_out, L)
        out = {}
        if "weight" in names:
            out["weight"] = torch.bmm(g, self.patches(m, _precise(a))).view(n, *m.weight.shape)
        if "bias" in names:
            out["bias"] = torch.mv(g.reshape(-1, g.shape[2]), g.new_ones(g.shape[2])).view(n, g.shape[1])
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
        a32, g32 = _precise(a), _precise(g)
        if saved is not None:  # x_hat = (x - mean) / std, as layer_norm computes it, from the forward's own statistics
            x_hat = (a32 - saved[0]).mul_(saved[1])
        else:
            x_hat = F.rms_norm(a32, shape, eps=m.eps) if isinstance(m, nn.RMSNorm) else F.layer_norm(a32, shape, eps=m.eps)
        keep = tuple(range(1, a.dim() - len(shape)))
        x_hat, g32 = _abs(x_hat, absolute), _abs(g32, absolute)
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
        g32 = _abs(_precise(g), absolute)
        names = trainable(m)
        out = {}
        if "weight" in names:
            x_hat = _abs(F.group_norm(_precise(a), m.num_groups, eps=m.eps), absolute)
            out["weight"] = x_hat.mul_(g32).flatten(2).sum(2) if a.dim() > 2 else x_hat.mul_(g32)
        if "bias" in names:
            out["bias"] = g32.flatten(2).sum(2) if a.dim() > 2 else g32
        return out


class Conv1DRule(LinearRule):
    """Hugging Face's Conv1D (GPT-2's projections): a Linear whose weight is stored transposed, (d_in, d_out),
    y = x W + b. The Linear rule on the same a and g; its per-sample weight gradients and its clipped sum are written
    in the transposed layout (a transposed view: the same products, rounded alike, so the Linear bound holds as is)."""

    @staticmethod
    def per_sample(m, a, g):
        out = LinearRule.per_sample(m, a, g)
        if "weight" in out:
            out["weight"] = out["weight"].transpose(1, 2)
        return out

    def add_clipped(self, m, state, factor, view_of):
        if "weight" in trainable(m):  # a frozen weight (BitFit: biases only) has no view
            view_of = {**view_of, id(m.weight): view_of[id(m.weight)].t()}
        super().add_clipped(m, state, factor, view_of)

    def sample(self, m, calls, k, absolute=False):
        out = super().sample(m, calls, k, absolute)
        if "weight" in out:
            out["weight"] = out["weight"].t()
        return out


def _hf_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D itself (not a subclass), recognised without importing transformers (an optional extra)."""
    return type(m).__name__ == "Conv1D" and type(m).__module__ == "transformers.pytorch_utils"


RULES: dict[type, object] = {nn.Linear: LinearRule(), nn.Embedding: EmbeddingRule(), nn.Conv1d: ConvRule(),
                             nn.Conv2d: ConvRule(), nn.LayerNorm: LayerNormRule(), nn.RMSNorm: LayerNormRule(),
                             nn.GroupNorm: GroupNormRule()}
CONV1D = Conv1DRule()
PATCH_CONV = PatchConvRule()  # picked by rule_for for the convolutions it applies to
PARAMETERS = {nn.Linear: {"weight", "bias"}, nn.Embedding: {"weight"}, nn.Conv1d: {"weight", "bias"},
              nn.Conv2d: {"weight", "bias"}, nn.LayerNorm: {"weight", "bias"}, nn.RMSNorm: {"weight"},
              nn.GroupNorm: {"weight", "bias"}}


def rule_for(m: nn.Module) -> tuple[object | None, str | None]:
    """(the rule, None), or (None, why book-keeping cannot clip this layer)."""
    name = type(m).__name__
    if _hf_conv1d(m):
        if {n for n, _ in m.named_parameters(recurse=False)} - {"weight", "bias"} or m._forward_pre_hooks:
            return None, f"cannot see how {name}'s weight is computed (extra parameters or pre-hooks)"
        return CONV1D, None
    base = next((t for t in RULES if type(m).forward is t.forward and isinstance(m, t)), None)
    if base is None:  # a subclass that computes otherwise (a LoRA-merged weight, scaled weights...), or no rule
        return None, f"has no rule for {name}"
    if {n for n, _ in m.named_parameters(recurse=False)} - PARAMETERS[base] or m._forward_pre_hooks:
        return None, f"cannot see how {name}'s weight is computed (extra parameters or pre-hooks)"
    if base is nn.Embedding and (m.max_norm is not None or m.scale_grad_by_freq):
        return None, "cannot clip nn.Embedding with max_norm (renormalises the weight in place) or " \
                     "scale_grad_by_freq (scales by counts over the whole batch: examples mix)"
    if base in (nn.Conv1d, nn.Conv2d) and PatchConvRule.applies(m):
        return PATCH_CONV, None
    return RULES[base], None
