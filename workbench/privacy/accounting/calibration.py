"""Choosing the mechanism's numbers: the smallest sigma that meets a target epsilon (:func:`calibrate_noise`), the
default delta, and the checks of the privacy arguments."""

from __future__ import annotations

import math

from workbench.errors import WorkbenchError
from workbench.privacy.accounting.accountant import Accountant
from workbench.privacy.accounting.events import _is_int, _is_real
from workbench.privacy.accounting.lazy import _rdp, dp_accounting
from workbench.privacy.accounting.solve import meeting_end

# calibrate_noise searches sigma in this bracket. Below 0.3 DP-SGD gives next to no privacy and the PLD of a step
# becomes very wide (slow); above 1000 no useful training happens.
SIGMA_MIN = 0.3
SIGMA_MAX = 1000.0
# calibrate_noise returns a sigma within this relative distance above the smallest acceptable one.
SIGMA_RTOL = 2e-3


_GUESS_ORDERS = [*range(2, 65), 80, 96, 128, 192, 256]  # integer RDP orders: no fractional-order warnings


def _rdp_guess(sample_rate: float, steps: int, target_epsilon: float, delta: float, world_size: int,
               shard: str) -> float:
    """A cheap starting sigma (Poisson RDP on integer orders; ``global`` as Poisson at the mean multiplicity)."""
    q = sample_rate if shard == "per_rank" else min(1.0, world_size * sample_rate)

    def eps(sigma: float) -> float:
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        return _rdp.RdpAccountant(orders=_GUESS_ORDERS).compose(event).get_epsilon(delta)

    lo, hi = math.log(SIGMA_MIN), math.log(SIGMA_MAX)
    if eps(SIGMA_MIN) <= target_epsilon:
        return SIGMA_MIN
    if eps(SIGMA_MAX) > target_epsilon:
        return SIGMA_MAX
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if eps(math.exp(mid)) <= target_epsilon else (mid, hi)
    return math.exp(hi)


def calibrate_noise(kind: str, sample_rate: float, steps: int, target_epsilon: float, delta: float,
                    world_size: int = 1, shard: str = "per_rank", **accountant_kwargs) -> float:
    """The smallest sigma in [SIGMA_MIN, SIGMA_MAX] (to within a factor 1 + SIGMA_RTOL above it) for which
    ``Accountant(kind, sample_rate, sigma, world_size, shard, **accountant_kwargs)`` reports
    ``epsilon(steps, delta) <= target_epsilon``. Never overshoots: the returned sigma meets the target.

    Returns ``SIGMA_MIN`` when that already meets the target; raises ``WorkbenchError`` when ``SIGMA_MAX`` does not.
    Search: bracket around an RDP starting guess by growing multiplicative steps, then regula falsi (Illinois) on
    log(epsilon) vs log(sigma) (solve.py); typically 6-10 evaluations of the accountant.
    """
    if not (_is_real(target_epsilon) and 0 < target_epsilon < math.inf):
        raise WorkbenchError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    if not (_is_int(steps) and steps >= 1):
        raise WorkbenchError(f"steps must be an integer >= 1 to calibrate the noise, got {steps!r}")
    steps = int(steps)
    # validate kind / shard / q / W / delta / kwargs up front, before any work
    Accountant(kind, sample_rate, 1.0, world_size, shard, **accountant_kwargs).epsilon(0, delta)

    evals: dict[float, float] = {}

    def eps(sigma: float) -> float:
        if sigma not in evals:
            acc = Accountant(kind, sample_rate, sigma, world_size, shard, **accountant_kwargs)
            evals[sigma] = acc.epsilon(steps, delta)
        return evals[sigma]

    # bracket: lo misses the target, hi meets it
    sigma = _rdp_guess(sample_rate, steps, target_epsilon, delta, world_size, shard)
    factor = 1.1
    if eps(sigma) <= target_epsilon:
        hi, lo = sigma, None
        while lo is None:
            if hi == SIGMA_MIN:
                return SIGMA_MIN
            sigma = max(hi / factor, SIGMA_MIN)
            if eps(sigma) <= target_epsilon:
                hi = sigma
            else:
                lo = sigma
            factor **= 2
    else:
        lo, hi = sigma, None
        while hi is None:
            if lo == SIGMA_MAX:
                raise WorkbenchError(
                    f"target_epsilon={target_epsilon} is unreachable: even noise_multiplier={SIGMA_MAX:g} gives "
                    f"epsilon={eps(SIGMA_MAX):.4g} after {steps} steps at sample_rate={sample_rate:.6g} "
                    f"(delta={delta:g}, accountant={kind}, shard={shard}, world_size={world_size}); "
                    "take fewer steps or a smaller batch")
            sigma = min(lo * factor, SIGMA_MAX)
            if eps(sigma) <= target_epsilon:
                hi = sigma
            else:
                lo = sigma
            factor **= 2

    hi = meeting_end(eps, target_epsilon, lo, hi, rtol=SIGMA_RTOL)
    if not eps(hi) <= target_epsilon:  # cannot happen: meeting_end returns only a point that met the target
        raise AssertionError(f"calibrate_noise overshot: epsilon({hi}) = {eps(hi)} > {target_epsilon}")
    return hi



def default_delta(dataset_size: int) -> float:
    """A delta below 1/N: the power of ten at least 10x below 1/N, capped at 1e-5 (1e-5 for N=1437, 1e-6 for 60000)."""
    if not (_is_int(dataset_size) and dataset_size >= 1):
        raise WorkbenchError(f"dataset_size must be an integer >= 1, got {dataset_size!r}")
    return min(1e-5, 10.0 ** (-math.ceil(math.log10(int(dataset_size))) - 1))


def validate_privacy_args(target_epsilon: float | None, delta: float | None, noise_multiplier: float | None,
                          max_grad_norm: float, dataset_size: int) -> list[str]:
    """Raise ``WorkbenchError`` on an impossible privacy setting; return warnings (strings) for doubtful ones.

    ``target_epsilon``, ``delta`` and ``noise_multiplier`` may be None (not set).
    """
    warnings: list[str] = []
    if target_epsilon is not None and not (_is_real(target_epsilon) and target_epsilon > 0):
        raise WorkbenchError(f"target_epsilon must be > 0, got {target_epsilon!r}")
    if delta is not None and not (_is_real(delta) and 0 < delta < 1):
        raise WorkbenchError(f"delta must be in (0, 1), got {delta!r}")
    if not (_is_real(max_grad_norm) and 0 < max_grad_norm < math.inf):
        raise WorkbenchError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm!r}")
    if noise_multiplier is not None and not (_is_real(noise_multiplier) and 0 <= noise_multiplier < math.inf):
        raise WorkbenchError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    if not (_is_int(dataset_size) and dataset_size >= 1):
        raise WorkbenchError(f"dataset_size must be an integer >= 1, got {dataset_size!r}")
    if delta is not None and delta >= 1.0 / dataset_size:
        warnings.append(f"delta={delta:g} should be below 1/N={1.0 / dataset_size:.3g} (N={dataset_size}); "
                        f"e.g. {default_delta(dataset_size):g}")
    if noise_multiplier == 0:
        warnings.append("noise_multiplier=0 gives no privacy (epsilon=inf)")
    return warnings
