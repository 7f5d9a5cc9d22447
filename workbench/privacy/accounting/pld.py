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

