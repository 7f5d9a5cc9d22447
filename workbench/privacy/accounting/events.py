"""The DP event of a run: what the accountant accounts (docs/DESIGN.md, "Accounting").

``shard="per_rank"``: every step is a Poisson-subsampled Gaussian, ``PoissonSampled(q, Gaussian(sigma))``.
``shard="global"`` ("parallel Poisson"): each of the W ranks Poisson-samples every example at rate ``q_r``, so an
example's multiplicity in a step is ``K ~ Binomial(W, q_r)`` and the step is the mixture of Gaussians
``sum_k Binom(k; W, q_r) N(k, sigma^2)`` vs ``N(0, sigma^2)`` (``MixtureOfGaussiansDpEvent``). For ``W == 1`` that
mixture *is* the Poisson-subsampled Gaussian, and the Poisson event is returned.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from workbench.errors import WorkbenchError
from workbench.privacy.accounting.lazy import dp_accounting
from workbench.privacy.sampling import SHARDS


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_event_args(sample_rate: float, noise_multiplier: float, world_size: int, shard: str) -> None:
    if shard not in SHARDS:
        raise WorkbenchError(f"shard={shard!r} is unknown; choose one of {', '.join(SHARDS)}")
    if not (_is_int(world_size) and world_size >= 1):
        raise WorkbenchError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not (_is_real(sample_rate) and 0 < sample_rate <= 1):
        raise WorkbenchError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if not (_is_real(noise_multiplier) and 0 <= noise_multiplier < math.inf):
        raise WorkbenchError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")


def multiplicity_probs(sample_rate: float, world_size: int, shard: str) -> list[float]:
    """P(K = k) for an example's multiplicity K in one step: Bernoulli(q) (per_rank, or W = 1), Binomial(W, q_r)
    (global). The accountant's event and the audit's observer both read it from here."""
    w, q = int(world_size), float(sample_rate)
    if shard == "per_rank" or w == 1:
        return [1.0 - q, q]
    return [math.comb(w, k) * q**k * (1.0 - q) ** (w - k) for k in range(w + 1)]


def _step_event(sample_rate: float, noise_multiplier: float, world_size: int, shard: str) -> dp_accounting.DpEvent:
    if shard == "per_rank" or world_size == 1:
        return dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    return dp_accounting.dp_event.MixtureOfGaussiansDpEvent(
        standard_deviation=noise_multiplier,
        sensitivities=[float(k) for k in range(world_size + 1)],
        sampling_probs=multiplicity_probs(sample_rate, world_size, shard),
    )


def dp_event(sample_rate: float, noise_multiplier: float, steps: int, world_size: int = 1,
             shard: str = "per_rank") -> dp_accounting.DpEvent:
    """The ``dp_accounting`` event of ``steps`` logical DP-SGD steps.

    ``sample_rate`` is the per-rank Poisson rate (``q`` for per_rank, ``q_r`` for global); ``noise_multiplier`` is
    the total noise std in units of the clipping norm (noise is added once cluster-wide).
    """
    _check_event_args(sample_rate, noise_multiplier, world_size, shard)
    if not (_is_int(steps) and steps >= 0):
        raise WorkbenchError(f"steps must be an integer >= 0, got {steps!r}")
    return dp_accounting.SelfComposedDpEvent(_step_event(sample_rate, noise_multiplier, world_size, shard), int(steps))

