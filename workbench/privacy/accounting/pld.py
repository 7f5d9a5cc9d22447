"""Single-step privacy loss distributions, built as dp_accounting's PLDAccountant builds them but with the vectorised
privacy losses of pld_losses.py (seconds faster per step PLD)."""

from __future__ import annotations

from workbench.privacy.accounting.lazy import _pld, _plm, _vectorized, dp_accounting

# PLD value discretization interval (the grid of privacy-loss values). Pessimistic rounding keeps every value an
# upper bound; a coarser grid is looser but faster. The looseness grows ~quadratically in the interval and linearly in
# the steps: at q=1e-3, sigma=1.37, 100k steps (epsilon ~0.99) it is +0.1% at 1e-4, +0.5% at 2e-4, +3% at 5e-4 and
# +13% at 1e-3 (where PLD would lose to PRV and even RDP). 2e-4 keeps PLD the tightest of the three while an epsilon
# of 100k Poisson steps takes 0.1-0.6 s and a calibration 0.3-3 s on 2 CPU cores (measured; see tests).
DEFAULT_PLD_DISCRETIZATION = 2e-4


def _gaussian_pld(standard_deviation: float, sampling_prob: float,
                  value_discretization_interval: float) -> _pld.PrivacyLossDistribution:
    """``privacy_loss_distribution.from_gaussian_mechanism`` (its defaults, add-or-remove) with the fast inverse."""
    def pmf(adjacency):
        return _pld._create_pld_pmf_from_monotone_privacy_loss(  # pylint: disable=protected-access
            _vectorized._VectorizedGaussianPrivacyLoss(standard_deviation, sampling_prob=sampling_prob, adjacency_type=adjacency),
            pessimistic_estimate=True, value_discretization_interval=value_discretization_interval,
            use_connect_dots=True)

    try:
        if sampling_prob == 1.0:
            return _pld.PrivacyLossDistribution(pmf(_plm.AdjacencyType.REMOVE))
        return _pld.PrivacyLossDistribution(pmf(_plm.AdjacencyType.REMOVE), pmf(_plm.AdjacencyType.ADD))
    except AttributeError:  # dp_accounting internals moved: fall back to the (slower) public function
        return _pld.from_gaussian_mechanism(standard_deviation, sampling_prob=sampling_prob,
                                            value_discretization_interval=value_discretization_interval)


def _mixture_gaussian_pld(standard_deviation: float, sensitivities, sampling_probs,
                          value_discretization_interval: float) -> _pld.PrivacyLossDistribution:
    """``privacy_loss_distribution.from_mixture_gaussian_mechanism`` (its defaults) with the fast inverse."""
    try:
        pmfs = [
            _pld._create_pld_pmf_from_monotone_privacy_loss(  # pylint: disable=protected-access
                _vectorized._VectorizedMixtureGaussianPrivacyLoss(standard_deviation, sensitivities, sampling_probs,
                                                      pessimistic_estimate=True, adjacency_type=adjacency),
                pessimistic_estimate=True, value_discretization_interval=value_discretization_interval,
                use_connect_dots=True)
            for adjacency in (_plm.AdjacencyType.REMOVE, _plm.AdjacencyType.ADD)
        ]
    except AttributeError:  # dp_accounting internals moved: fall back to the (slow) public function
        return _pld.from_mixture_gaussian_mechanism(standard_deviation, sensitivities, sampling_probs,
                                                    value_discretization_interval=value_discretization_interval)
    return _pld.PrivacyLossDistribution(*pmfs)


def _step_pld(event: dp_accounting.DpEvent, d: float) -> _pld.PrivacyLossDistribution:
    """The PLD of one step, built exactly as ``PLDAccountant(value_discretization_interval=d)`` builds it."""
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        return _gaussian_pld(event.event.noise_multiplier, event.sampling_probability, d)
    return _mixture_gaussian_pld(event.standard_deviation, event.sensitivities, event.sampling_probs, d)




_TAIL_MASS = 1e-15  # dp_accounting's default tail_mass_truncation for self_compose


class StepPLD:
    """One step's PLD, self-composed ``n`` times bit for bit as ``PrivacyLossDistribution.self_compose(n)`` does it,
    faster when one step PLD is composed many times (a run's epsilon schedule, the budget search).

    dp_accounting truncates each composition's support with Chernoff bounds from 40 log moment generating functions of
    the step's PMF (one scipy ``logsumexp`` each). They depend on the step alone, not on ``n``, yet are recomputed on
    every composition: about 85% of a composition's time on a coarse grid. Here they are computed once per PMF, by
    the same calls in the same order, so the bounds, the FFT and every probability are the library's own
    (tests/test_accounting.py compares them).
    """

    def __init__(self, pld: "_pld.PrivacyLossDistribution"):
        self.pld = pld
        self._dense: dict[str, tuple] = {}  # "remove" | "add" -> (the dense PMF, its log-MGFs)

    def self_compose(self, n: int) -> "_pld.PrivacyLossDistribution":
        # pylint: disable=protected-access
        composed = [self._compose("remove", self.pld._pmf_remove, n)]
        if not self.pld._symmetric:
            composed.append(self._compose("add", self.pld._pmf_add, n))
        return _pld.PrivacyLossDistribution(*composed)

    def _compose(self, side: str, pmf, n: int):
        """``PLDPmf.self_compose(n)``: a sparse PMF the library's way while it stays small, else
        ``DensePLDPmf.self_compose`` (with ``common.self_convolve``) from the kept log-MGFs."""
        import math

        import numpy as np
        from dp_accounting.pld import pld_pmf
        from scipy import fft, special

        # pylint: disable=protected-access
        if n <= 0:
            raise ValueError(f"num_times should be >= 1, num_times={n}")
        # the library's test is size ** n > 1000; past n = 10 that is size >= 2, as size ** 11 > 1000 says (no huge int)
        if not isinstance(pmf, pld_pmf.DensePLDPmf) and (n == 1 or pmf.size ** min(n, 11) <= pld_pmf._MAX_PMF_SPARSE_SIZE):
            return pmf.self_compose(n, _TAIL_MASS)
        if side not in self._dense:
            dense = pmf.to_dense_pmf()
            size = len(dense._probs)
            orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / size
            self._dense[side] = dense, orders, [special.logsumexp(np.arange(size) * order, b=dense._probs)
                                                for order in orders]
        dense, orders, log_mgfs = self._dense[side]
        probs_in = dense._probs
        lower, upper = 0, (len(probs_in) - 1) * n  # common.compute_self_convolve_bounds from here
        for order, log_mgf in zip(orders, log_mgfs):
            bound = (n * log_mgf + math.log(2 / _TAIL_MASS)) / order
            if not math.isfinite(bound):
                continue
            if order > 0:
                upper = min(upper, math.ceil(bound))
            if order < 0:
                lower = max(lower, math.floor(bound))
        output_len = upper - lower + 1  # common.self_convolve from here
        fast_len = fft.next_fast_len(max(output_len, len(probs_in)))
        convolved = np.real(fft.ifft(fft.fft(probs_in, fast_len) ** n))
        probs = np.array(np.roll(convolved, -lower)[:output_len])
        infinity_mass = _TAIL_MASS - math.expm1(n * math.log1p(-dense._infinity_mass))
        return pld_pmf.DensePLDPmf(dense._discretization, dense._lower_loss * n + lower, probs, infinity_mass,
                                   dense._pessimistic_estimate)
