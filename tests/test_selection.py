"""The privacy-profile bound for publishing the best of K trials (workbench/privacy/accounting/selection.py): the
derivative of K's generating function, and a bound never below the exact selection privacy of toy mechanisms whose
best-of-K law is computed here exactly."""

import math

import numpy as np
import pytest

from workbench.privacy.accounting import selection, tuning


def _exact_selection_delta(p, p_other, phi):
    """eps -> delta(eps) of publishing the best of K draws of a mechanism on a finite ordered outcome set (ascending
    pmfs p, p_other on neighbouring data), K with generating function phi: exact, both directions. The best of K has
    P[best <= y] = phi(F(y)) (and is nothing with probability phi(0))."""
    def law(pmf):
        cdf = np.concatenate([[0.0], np.cumsum(pmf)])
        return np.concatenate([[phi(0.0)], phi(cdf[1:]) - phi(cdf[:-1])])

    a, b = law(np.asarray(p)), law(np.asarray(p_other))
    return lambda eps: max(np.maximum(a - math.exp(eps) * b, 0).sum(), np.maximum(b - math.exp(eps) * a, 0).sum())


def _exact_profile(p, p_other):
    p, p_other = np.asarray(p), np.asarray(p_other)
    return lambda ts: np.array([max(np.maximum(p - math.exp(t) * p_other, 0).sum(),
                                    np.maximum(p_other - math.exp(t) * p, 0).sum()) for t in ts])


def _tnb_phi(eta, gamma):
    return lambda z: sum(tuning._tnb_pmf(k, eta, gamma) * np.asarray(z, dtype=float) ** k for k in range(1, 400))


TOYS = {  # (p, p_other): randomized response with e^eps0 = 3; a 4-level ordered mechanism whose order follows its loss
    "randomized-response": ([0.25, 0.75], [0.75, 0.25]),
    "ordered-4": ([0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]),
}


TRIALS = {"poisson-3": ("poisson", 3.0, 0.0, 0.2, lambda z: np.exp(3.0 * (np.asarray(z, dtype=float) - 1))),
          "geometric": ("truncated_negative_binomial", 3.0, 1.0, 0.2, _tnb_phi(1.0, 0.2)),
          "logarithmic": ("truncated_negative_binomial", 3.0, 0.0, 0.1, _tnb_phi(0.0, 0.1)),
          "tnb-eta-0.5": ("truncated_negative_binomial", 3.0, 0.5, 0.3, _tnb_phi(0.5, 0.3))}


@pytest.mark.parametrize("trials", TRIALS)
def test_the_generating_function_derivative_is_the_distributions(trials):
    kind, mu, eta, gamma, phi = TRIALS[trials]
    u = np.linspace(0, 1, 11)[:-1]
    numeric = (phi(u + 1e-6) - phi(u - 1e-6)) / 2e-6
    assert selection.pgf_derivative(kind, mu, eta, gamma)(u) == pytest.approx(numeric, rel=1e-4)
    assert selection.pgf_derivative(kind, mu, eta, gamma)(np.array([1.0]))[0] == pytest.approx(
        tuning.expected_trials(kind, mu, eta, gamma))


@pytest.mark.parametrize("toy", TOYS)
@pytest.mark.parametrize("trials", TRIALS)
def test_the_profile_bound_is_never_below_the_exact_selection_privacy_of_a_toy(toy, trials):
    kind, mu, eta, gamma, phi = TRIALS[trials]
    p, p_other = TOYS[toy]
    exact_delta = _exact_selection_delta(p, p_other, phi)
    for delta in (1e-2, 1e-5):
        bound = selection.profile_epsilon(_exact_profile(p, p_other), delta, selection.pgf_derivative(kind, mu, eta, gamma))
        assert math.isfinite(bound)
        assert exact_delta(bound) <= delta  # valid: the exact delta at our epsilon
        exact = next(e for e in np.arange(0, bound + 1, 1e-3) if exact_delta(e) <= delta)
        assert exact <= bound <= 2.5 * exact  # and not vacuous (geometric K, E[K] = 5: about 2x)
