"""What every layer family's rule shares: the trainable parameters, float32 at least, the clipped-sum kernels' chunks
of examples and their rounding depth, and small tensor helpers."""

from __future__ import annotations

import math

import torch
from torch import nn

Calls = list[tuple[torch.Tensor, torch.Tensor]]  # (layer input a, gradient g of its output) per call


def trainable(m: nn.Module) -> list[str]:
    return [name for name, p in m._parameters.items() if p is not None and p.requires_grad]  # no generator: per call


_WIDE = (torch.float32, torch.float64)


def precise(t: torch.Tensor) -> torch.Tensor:
    """A layer input or output gradient in float32 at least (no-op in float32/64; integer ids kept)."""
    if t.dtype in _WIDE or not t.is_floating_point():
        return t
    return t.to(torch.promote_types(t.dtype, torch.float32))


def gram64(t: torch.Tensor) -> torch.Tensor:
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


def position_sums(g: torch.Tensor) -> torch.Tensor:
    """sum_t g_t of (n, T, d), (n, d): on wide layers a matmul with ones (measured 3.3x faster than g.sum(1) at
    d = 1536, T = 128; 1.1-1.2x slower at d <= 384), the same sums of T terms as rounded."""
    if g.shape[-1] <= 512:
        return g.sum(1)
    return torch.matmul(g.new_ones(1, g.shape[1]), g).squeeze(1)


def cat(ts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts, dim)  # cat copies even one tensor


def abs_if(t: torch.Tensor, absolute: bool) -> torch.Tensor:
    return t.abs() if absolute else t


def per_example(t: torch.Tensor) -> int:
    return t.numel() // max(1, len(t))


PER_SAMPLE_IF = 1.0  # per-sample gradients formed where they take at most this many times the memory of a and g


def smaller_kept(m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether holding a and g costs clearly less memory than m's trainable per-sample gradients (forming those saves
    the clipped sum's weight-gradient kernel: within a margin they are worth their memory)."""
    return PER_SAMPLE_IF * (per_example(a) + per_example(g)) < sum(getattr(m, name).numel() for name in trainable(m))


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
