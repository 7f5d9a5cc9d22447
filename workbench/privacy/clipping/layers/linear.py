"""The Linear family's rules: nn.Linear (rows and sequences), Linears joined on one input (q, k, v) and Hugging
Face's Conv1D (a Linear stored transposed)."""

from __future__ import annotations

import math

import torch
from torch import nn

from workbench.privacy.clipping.bound import (SUBNORMAL, UNDERFLOW, U32, U64, Bound, example_norms, gamma,
                                              diagonal_norms, gram32_margin, squares)
from workbench.privacy.clipping.layers.common import (Calls, abs_if, cat, gram64, kernel_depth, per_call, per_example,
                                                      position_sums, precise, trainable)


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
        if cls.FORM_IF * (per_example(a) + per_example(g)) < weights:
            return True  # forming would take too much memory
        t, d_in, d_out = per_example(a) // a.shape[-1], a.shape[-1], g.shape[-1]
        return "weight" in trainable(m) and cls.gram_pays(t, d_in, d_out, cls.FORM_COST - 1.0)

    @classmethod
    def gram_pays(cls, t: int, d_in: int, d_out: int, against: float) -> bool:
        """Whether the Gram matrices of a (T, d_in) input and (T, d_out) output gradient cost less than ``against``
        units of T d_in d_out (see the class docstring)."""
        return cls.GRAM_COST * t * (d_in + d_out) < against * d_in * d_out

    @staticmethod
    def per_sample(m, a, g):
        n = len(a)
        a, g = precise(a).reshape(n, -1, a.shape[-1]), precise(g).reshape(n, -1, g.shape[-1])
        names = trainable(m)
        out = {"weight": LinearRule._weights(a, g)} if "weight" in names else {}
        if "bias" in names:
            out["bias"] = position_sums(g)
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
            return tuple(precise(t) for t in calls[0])
        return tuple(cat([precise(t).reshape(n, -1, t.shape[-1]) for t in ts], 1) for ts in zip(*calls))

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
        b = squares(position_sums(g)) if "bias" in names else None
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
        ga, gg = gram64(a), gram64(g)
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
        c = per_call(per_example(a) // a.shape[-1])
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
        a, g = abs_if(a, absolute), abs_if(g, absolute)
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
        return (precise(a).reshape(n, -1, a.shape[-1]),
                torch.cat([precise(g).reshape(n, -1, g.shape[-1]) for _, g in calls], -1))


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
