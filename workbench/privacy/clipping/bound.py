"""The floating-point bound: each example's contribution, as actually summed, has norm <= C (1 + RHO).

DP-SGD's sensitivity is about the tensors added, not the norms a strategy believes. A norm computed from one set of
numbers (a float64 Gram matrix, a float32 sum of squares) and a sum computed from another (a float32 kernel) lets
rounding escape the clip: one example whose large inputs cancel across positions has a true gradient near 0 (factor 1),
yet the kernel's rounding error is released at hundreds of times C (Casacuberta et al., CCS 2022). So every route
clips against a *certified upper bound* on the norm of what its kernel will add, never an estimate.

The argument (u = 2^-24, float32's unit roundoff; gamma_k = k u / (1 - k u), the classic bound on k roundings):

1. Each rule returns a :class:`Bound` per example i: ``n2`` >= the squared norm of the gradient it computed (float32
   squares summed in blocks of at most ``BLOCK``: relative error <= gamma_{BLOCK+3} whatever the order, in ``rel``;
   squares lost below 2^-126 in ``floor``; block sums in float64), and ``err`` >= how far the vector its kernel adds
   can be from that gradient, *before* the clip factor. A kernel that sums K products (a matmul over n examples and T
   positions: K = nT) returns exactly sum_k p_k (1 + theta_k) with |theta_k| <= gamma_K (backward error: any order,
   any blocking, FMA or not): example i's share of the sum is its own terms, each perturbed by at most gamma_K, so
   its distance from the exact gradient is at most gamma_K S_i, S_i = sum_t ||g_it|| ||a_it|| (>= the Frobenius norm
   of sum_t |g_it| |a_it|^T; bounded above by ||g_i||_F ||a_i||_F, Cauchy-Schwarz). Kernels run on chunks of examples
   (``layers.KERNEL_ROWS``) so that K is public and small: it never depends on how many examples were drawn. Rules that form per-sample gradients clip exactly what they sum (their error is
   gamma_{n+2} of the norm, in ``rel``: one matrix-vector product and the add into the buffer; kept convolutions that
   keep the per-sample gradients formed for their norms add one product per chunk of examples: a term is rounded by
   its chunk's product, then by each chunk's add, at most n + 1 times, within the same gamma_{n+2}). A kernel may be
   swapped for another that sums the same K products (a convolution's weight gradient as patches @ g, per example
   or over the batch; per-sample ones as matmuls of g, spread among exact zeros, with shifted runs of input rows,
   ``ConvRule._formed_by_shifts``: a product of an exact zero and a finite input is an exact zero and adding it
   leaves a partial sum as it was, so every entry sums the same products; a non-finite input makes it NaN, a bound
   that is not finite, hence the float64 route of 4.): the gamma_K argument is about the products summed, not the
   kernel. Gram routes (kept convolutions, kept Linear sequences) compute n2 in float64 from the exact float64
   copies of a and g, within gamma64_D S_i^2 of the exact squared norm (D = d_in + d_out + T^2 + 2 roundings per
   term), so their norm is within sqrt(gamma64_D) S_i of it: that margin is in ``err`` beside the kernel's. Kept
   Linear sequences take their Gram matrices in float32 first (:func:`gram32_margin`: the sum within M_i of the
   exact squared norm, so max(sum, 0) + M_i is an upper bound in ``n2``); an example whose M_i is not small beside
   its sum is recomputed by the float64 route. Small Gram matrices are taken in float64 directly
   (``LinearRule._bound64``), the bias folded in as an input column of 1s (a'_t = [a_t, 1]: one more term per dot
   product, D = d_in + 1 + d_out + T^2 + 2, S = sum_t ||g_t|| ||a'_t||, which bounds the weight's and the bias's
   kernel error together: the bias's products are g_t 1).
2. The parts are disjoint blocks of the example's vector, so B_i = (sqrt(sum n2 + sum floor) + sum err)(1 + max rel)
   bounds the norm of the unscaled vector added; :func:`clip_factors` derives f_i <= 1 with f_i B_i <= C - slack
   (the float32 factor, its product with g and the float32 sums and (r)sqrt of the bound are inside a 1 + 8u).
3. Underflow: every operand a kernel multiplies by a scaled value has entries below 2^64, since larger ones make the
   float32 squares of its rule infinite (the float64 route below; the float64 Gram route sets n2 = inf for them); a
   scaled value rounded to a subnormal moves a product by at most 2^-149 2^64 = ``UNDERFLOW``, so an example's sum
   moves by at most ``slack`` (T sqrt(P) of them), which the factor leaves room for.
4. What float32 cannot scale exactly is not scaled there: an example whose factor is below 2^-60 or whose bound is
   not finite (a float32 square past 2^128, inf/NaN) is zeroed in the batch kernels and recomputed alone in float64
   (:func:`add_exact`): its gradient, norm and scaling in float64, cast once. A finite gradient is clipped to C
   there, never dropped; only one that is not finite in float64 contributes 0.

Hence RHO = 2^-20 covers the roundings left (the float64 route's cast). Outside the bound, stated in README: the
rounding of later additions (micro-batch sums into the step's buffer, the all-reduce, the noise), which round the
running total, and the floating-point Gaussian sampler itself (Mironov, CCS 2012). On CUDA the kernels the bound
relies on run in true float32 (:func:`exact_float32`): TF32 or oneDNN's bf16 mode would round their inputs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

U32 = 2.0 ** -24  # float32 unit roundoff (bf16/fp16 inputs are widened to float32 before any kernel here)
U64 = 2.0 ** -53
RHO = 2.0 ** -20  # each example's contribution <= C (1 + RHO); see the module docstring
BLOCK = 1024  # float32 partial sums of squares over at most this many entries, then float64
TINY_FACTOR = 2.0 ** -60  # below: float64 route (a float32 factor and its products would lose bits to underflow)
SUBNORMAL = 2.0 ** -148  # twice the most a square rounded below float32's normal range (2^-126) loses
# Every operand a kernel multiplies by a scaled value has entries below 2^64: larger ones overflow the float32
# squares its rule sums (inf: the float64 route). A scaled value rounded to a subnormal then moves a product by at
# most 2^-149 * 2^64, hence the absolute slack UNDERFLOW per term of an example's own sum (see Bound.slack).
UNDERFLOW = 2.0 ** -85
ILL_CONDITIONED = 2.0 ** -6  # kernel error past this share of an example's norm: the float64 route (clip_factors)


def gamma(k: float, u: float = U32) -> float:
    """Higham's gamma_k = k u / (1 - k u): the relative error bound of k successive roundings."""
    return k * u / (1.0 - k * u) if k * u < 0.5 else math.inf


class Bound(NamedTuple):
    """One route's bound for n examples: the norm of what its kernel adds for example i, before the clip factor, is at
    most (sqrt(n2_i + floor) + err_i) (1 + rel); after the factor, float32 underflow moves it by at most ``slack``.
    ``n2`` (n,) may be float32 (its rounding is in ``rel``; inf sends the example to the float64 route) or float64;
    the scalars cost no tensor operation (the MLP's step is a few hundred microseconds: every op counts)."""

    n2: torch.Tensor
    rel: float = 0.0
    err: torch.Tensor | None = None
    slack: float = 0.0
    floor: float = 0.0


def squares(t: torch.Tensor) -> Bound:
    """The sums of squares of per-sample tensors t (n, ...), as a Bound: float32 reductions over blocks of at most
    ``BLOCK`` entries (relative error <= gamma_{BLOCK+3} with the squaring, whatever the order; squares below 2^-126
    may round to 0: ``floor``), the blocks summed in float64. A block past float32's range is inf: that example takes
    the float64 route (:func:`add_exact`), where every float32 square is exact."""
    n = len(t)
    if t.dim() == 1:
        return Bound(t.double().square())
    # a stride order in which t is contiguous (Linear's per-sample weights are a transposed view): no copy
    order = sorted(range(1, t.dim()), key=lambda d: -t.stride(d))
    flat = t.permute(0, *order)
    flat = flat.reshape(n, -1) if flat[0].is_contiguous() else flat.contiguous().view(n, -1)
    p = flat.shape[1]
    rel = gamma(min(p, BLOCK) + 3, torch.finfo(t.dtype).eps / 2) / 2  # on the norm: half the squares' bound
    if p <= BLOCK:  # one block: one float32 reduction
        return Bound(torch.linalg.vector_norm(flat, dim=1).square_(), rel, floor=p * SUBNORMAL)
    whole = p // BLOCK * BLOCK
    out = torch.linalg.vector_norm(flat[:, :whole].view(n, whole // BLOCK, BLOCK), dim=2).square_().sum(
        1, dtype=torch.float64)
    if whole < p:
        out += torch.linalg.vector_norm(flat[:, whole:], dim=1).square_()
    return Bound(out, rel, floor=p * SUBNORMAL)


def example_norms(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Float64 upper bounds on each example's Frobenius norm of t (n, ...), and the relative error left to the caller
    (a float32 sum of squares): float32 squares (inf past 2^64, which sends the example to the float64 route), the
    squares lost below 2^-126 added back. For the magnitudes S in the kernels' error terms, by Cauchy-Schwarz:
    sum_t ||g_t|| ||a_t|| <= ||g||_F ||a||_F."""
    per_example = t[0].numel() if len(t) else 0
    sq = torch.linalg.vector_norm(t, dim=tuple(range(1, t.dim()))).square_().double()
    return sq.add_(per_example * SUBNORMAL).sqrt_(), gamma(per_example + 3) / 2


def diagonal_norms(gram: torch.Tensor, d: int) -> torch.Tensor:
    """(n, T) float64 upper bounds on the norms ||x_t|| of a sequence x (n, T, d), from the diagonal of its float32
    Gram matrix x x^T (n, T, T): each entry a float32 dot product of length d, within gamma_d ||x_t||^2 + d 2^-149 of
    the exact (see :func:`gram32_margin`), so ||x_t||^2 <= (G^_tt + d 2^-149) / (1 - gamma_d); the float64 add,
    division and square root rounded up by 1 + 4 u64. An infinite diagonal (past float32's range) stays infinite."""
    sq = gram.diagonal(dim1=1, dim2=2).double().add(d * 2.0 ** -149).div_(1.0 - gamma(d))
    return sq.sqrt_().mul_(1.0 + 4 * U64)


def gram32_margin(an: torch.Tensor, gn: torch.Tensor, d_in: int, d_out: int) -> torch.Tensor:
    """(n,) float64 M_i with |N^_i - N_i| <= M_i, where N_i = ||sum_t g_t a_t^T||^2 is the exact squared norm of float32
    inputs a (n, T, d_in), g (n, T, d_out) and N^_i = sum_{t,t'} fl32(<a_t,a_t'>) fl32(<g_t,g_t'>), the products
    (exact: two float32 significands fit in float64's) summed in float64 in any order; ``an``, ``gn``: upper bounds on
    ||a_t||, ||g_t|| (:func:`diagonal_norms`).

    Each float32 dot product of length d, however blocked, FMA or not, is within gamma_d sum_k |a_tk a_t'k| + d 2^-149
    of the exact (the relative part from the roundings, the absolute part from products rounded below 2^-126), and
    sum_k |a_tk a_t'k| <= ||a_t|| ||a_t'||. So with e_A = gamma_{d_in}, u_A = d_in 2^-149 (e_G, u_G alike), and
    |A_tt'| <= ||a_t|| ||a_t'||, |G_tt'| <= ||g_t|| ||g_t'||, summed over t, t':
        sum |A^ G^ - A G| <= (e_A + e_G + e_A e_G) S^2 + u_A (1 + e_G) G1^2 + u_G (1 + e_A) A1^2 + T^2 u_A u_G
    with S = sum_t ||a_t|| ||g_t||, A1 = sum_t ||a_t||, G1 = sum_t ||g_t||; call it E. The float64 sum of the T^2
    products adds at most gamma64_{T^2} sum |A^ G^| <= gamma64_{T^2} (S^2 + E). So M = E (1 + gamma64_{T^2}) +
    gamma64_{T^2} S^2; the float64 arithmetic of M itself (a few dozen roundings of positive terms) is inside a final
    1 + gamma64_64."""
    t = an.shape[1]
    s2 = torch.linalg.vecdot(an, gn).square_()
    a1, g1 = an.sum(1).square_(), gn.sum(1).square_()
    e_a, e_g, u_a, u_g = gamma(d_in), gamma(d_out), d_in * 2.0 ** -149, d_out * 2.0 ** -149
    e_sum = gamma(t * t, U64)
    absolute = g1.mul_(u_a * (1 + e_g)).add_(a1.mul_(u_g * (1 + e_a))).add_(t * t * u_a * u_g)
    relative = (e_a + e_g + e_a * e_g) * (1 + e_sum) + e_sum
    return s2.mul_(relative).add_(absolute.mul_(1 + e_sum)).mul_(1.0 + gamma(64, U64))


def materialised(t: torch.Tensor, batch: int) -> Bound:
    """The bound of per-sample gradients ``t`` (n, ...) that are summed as they are (one matrix-vector product with the
    factors, added into the buffer): clip what you sum, within gamma_{batch+2} of it (``batch``: the most examples a
    micro-batch may hold, public, so that no example's factor depends on how many others were drawn)."""
    b = squares(t)
    per_example = t[0].numel() if len(t) else 0
    return b._replace(rel=b.rel + gamma(batch + 2), slack=UNDERFLOW * math.sqrt(per_example))


SMALL = 256  # formed per-sample gradients of at most this many entries per example are stacked (stack_small):
# normalisation parameters and biases, not a small Linear's weights, whose stacked copy beside the originals was
# text_classifier's peak (1.97x -> 1.30x of non-private) and costs more than the ops it saves


def stack_small(formed: list[tuple[int, torch.Tensor]], n: int) -> list[tuple[object, torch.Tensor]]:
    """Formed per-sample gradients (parameter id, (n, *shape)), those of few entries per example (normalisation
    weights, biases, raw parameters) stacked into one (n, P) tensor per dtype, keyed by their parameter ids in order:
    one norm reduction and one matrix-vector product for all, not a few small ops each. The stacked tensor is what is
    summed, so its materialised bound is the bound of what is added, as for any formed tensor."""
    if not formed:
        return formed
    small: dict[torch.dtype, list] = {}
    out = []
    for key, t in formed:
        if t.numel() <= SMALL * max(1, n):
            small.setdefault(t.dtype, []).append((key, t))
        else:
            out.append((key, t))
    for group in small.values():
        if len(group) == 1:
            out += group
        else:
            flat = [t.reshape(n, t.numel() // max(1, n)) for _, t in group]  # (n,) a raw scalar's: (n, 1)
            out.append((tuple(k for k, _ in group), torch.cat(flat, 1)))
    return out


def clip_factors(parts: list[Bound], n: int, clip: float, buffer: torch.dtype,
                 device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The clip factors of n examples from their routes' bounds (consumed: the first part's ``n2`` is summed into),
    and the mask of examples to be recomputed alone in float64 (:func:`add_exact`; their factor here is 0 and callers
    zero their rows), or None when there is none: the usual case costs one host read. Which examples take that route is
    private: never log it.

    The parts are disjoint blocks of an example's vector: its norm before the factor is at most
    B = (sqrt(sum n2 + F) + sum err) (1 + max rel), F the squares lost to underflow. With
    f = min(1, c / (sqrt(sum n2) + sum err)), c = (C - slack - sqrt(F) (1 + max rel)) / ((1 + max rel) (1 + 16u)
    (1 + 2 u_buffer)), the vector added is at most f B (1 + 2u) (1 + u_buffer) + slack <= C: f B <= c (1 + max rel)
    + sqrt(F) (1 + max rel) whether f clips or not; the float32 factor, its products, the sums and (r)sqrt of the bound
    (2 ulp on CUDA) are inside the 1 + 16u, the cast into a bf16/fp16 buffer inside 1 + 2 u_buffer.

    Examples whose kernel error is not small beside their norm (err > ILL_CONDITIONED sqrt(n2): terms that cancel, the
    float32 sum mostly rounding) take the float64 route too: in a batch kernel their share of the rounding would
    depend on the other examples drawn (and on the summation order), which no per-example factor can bound."""
    if not parts:
        return torch.ones(n, device=device), None
    c = clip_scale(parts, clip, buffer)
    errs = [b.err for b in parts if b.err is not None]
    n2 = parts[0].n2.double() if errs and parts[0].n2.dtype != torch.float64 else parts[0].n2
    for b in parts[1:]:
        n2 += b.n2
    if errs:  # float64 throughout: one rounding per layer's err would not fit a fixed margin
        norm = n2.sqrt_()
        err = errs[0] if len(errs) == 1 else torch.stack(errs).sum(0)
        ill = err > norm * ILL_CONDITIONED
        factor = norm.add_(err).reciprocal_().mul_(c).masked_fill_(ill, 0.0)  # 0: below TINY_FACTOR, the float64 route
        factor.clamp_(max=1.0)
    else:
        factor = scaled(n2, c)
    if within(factor):
        return factor.float() if factor.dtype != torch.float32 else factor, None
    rows = ~(factor >= TINY_FACTOR)
    return factor.masked_fill_(rows, 0.0).float(), rows


def clip_scale(parts: list[Bound], clip: float, buffer: torch.dtype) -> float:
    """The c of :func:`clip_factors` for these parts (their scalars only, public: n2 and err are not read)."""
    rel = max(b.rel for b in parts) + gamma(len(parts) + 2)  # + the sums over parts
    u_buffer = torch.finfo(buffer).eps / 2
    room = clip - sum(b.slack for b in parts) - math.sqrt(sum(b.floor for b in parts)) * (1.0 + rel)
    return max(room, 0.0) / ((1.0 + rel) * (1.0 + 16 * U32) * (1.0 + 2 * u_buffer))


def scaled(n2: torch.Tensor, c: float) -> torch.Tensor:
    """min(1, c / sqrt(n2)): the factors of parts without ``err`` (n2 consumed)."""
    return n2.rsqrt_().mul_(c).clamp_(max=1.0)


def within(factor: torch.Tensor) -> bool:
    """Whether no example needs the float64 route: one reduction and one host read; min is NaN where any factor is
    (an inf/NaN bound), and NaN compares False, as do factors float32 would scale inexactly."""
    return not len(factor) or float(factor.min()) >= TINY_FACTOR


def zero_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t`` (batch first) with the masked examples' rows set to 0, out of place (``t`` may be a layer's input that
    the caller still holds); integer tensors (token ids) as they are."""
    if not t.is_floating_point():
        return t
    return t.masked_fill(rows.view(-1, *[1] * (t.dim() - 1)), 0)


def add_exact(grads: dict[int, torch.Tensor], clip: float, view_of: dict[int, torch.Tensor]) -> float:
    """One example's gradient (parameter id -> float64 tensor) clipped in float64 and added: its norm (scaled by its
    largest entry first, so that float64 models' huge gradients do not overflow the squares), factor and scaled values
    are float64, then cast once to the buffer (<= 1 + u per entry, plus subnormal rounding). A gradient that is not
    finite even in float64 contributes 0 (a function of that example alone, norm 0 <= C). Returns the clip factor
    (1: not scaled down; 0 for a gradient that is not finite), which adaptive clipping counts."""
    if not grads:
        return 1.0
    top = max(float(g.abs().max()) if g.numel() else 0.0 for g in grads.values())
    if top == 0.0 or not math.isfinite(top):  # nothing to add, or not finite even in float64
        return 1.0 if top == 0.0 else 0.0
    norm = top * math.sqrt(sum(float((g / top).square().sum()) for g in grads.values()))
    if not math.isfinite(norm):  # a NaN past the first parameter: max compared it away, min(1, C / NaN) would be 1
        return 0.0
    factor = min(1.0, clip / norm)
    for key, g in grads.items():
        view = view_of[key]
        view.add_((g * factor).to(view.dtype))
    return factor


def _flags(*names: str) -> tuple:
    """torch's per-backend float32 precision flags that exist in this build (objects with ``fp32_precision``)."""
    found = []
    for name in names:
        backend, op = name.split(".")
        flags = getattr(getattr(torch.backends, backend, None), op, None)
        if flags is not None and hasattr(flags, "fp32_precision"):
            found.append(flags)
    return tuple(found)


_PRECISION_FLAGS = {"cpu": _flags("mkldnn.matmul", "mkldnn.conv"), "cuda": _flags("cuda.matmul", "cudnn.conv")}


class exact_float32:  # noqa: N801 - a context manager, used like one
    """The bound's kernels in true float32: TF32 (CUDA) and oneDNN's bf16 float32 mode (CPUs with AMX or avx512_bf16,
    under ``torch.set_float32_matmul_precision("medium")``) round their inputs to 10 or 8 bits, which the gamma_K
    margins do not cover (a crafted example measured at 59 C that way). Only torch's per-backend flags of the device
    the kernels run on are touched (mixing its legacy TF32 switches with them makes torch raise); each is restored
    after. A class, not a generator: it runs on every micro-batch."""

    __slots__ = ("flags", "saved")

    def __init__(self, device: torch.device):
        self.flags = _PRECISION_FLAGS.get(device.type, ())
        self.saved: list = []

    def __enter__(self) -> None:
        for flags in self.flags:
            value = flags.fp32_precision
            if value != "ieee":
                self.saved.append((flags, value))
                flags.fp32_precision = "ieee"

    def __exit__(self, *exc) -> None:
        for flags, value in self.saved:
            flags.fp32_precision = value
        self.saved.clear()
