"""The one-run audit's bound (workbench.audit) against direct binomial sums, and its guesses and scores."""

import math

import numpy as np
import pytest

from workbench import audit


def _direct_p_value(m, r, v, eps, delta):
    """The theorem's right-hand side written out term by term: no scipy, no vectorisation."""
    q = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]
    beta = sum(pmf[v:])
    alpha = max((sum(pmf[v - i:v]) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, beta + 2 * m * delta * alpha)


@pytest.mark.parametrize("m,r,v,eps,delta", [
    (1000, 100, 90, 1.0, 0.0), (1000, 100, 90, 2.0, 1e-5), (1000, 200, 200, 3.0, 1e-5), (100, 50, 30, 0.5, 1e-3),
    (1000, 500, 260, 0.1, 1e-6), (10, 10, 7, 0.0, 0.01),
])
def test_p_value_matches_direct_binomial_sums(m, r, v, eps, delta):
    assert audit.p_value(m, r, v, eps, delta) == pytest.approx(_direct_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


def test_all_correct_without_delta_has_a_closed_form():
    # v = r: p = q^r, so the bound solves q = level^(1/r): eps = log(q / (1 - q)).
    r, level = 200, 0.05 / 16
    q = level ** (1 / r)
    assert audit.epsilon_lower_bound(1000, r, r, 0.0, level) == pytest.approx(math.log(q / (1 - q)), rel=1e-9)


@pytest.mark.parametrize("r,v,delta", [(200, 200, 1e-5), (100, 85, 1e-5), (500, 300, 1e-6)])
def test_bound_is_where_the_direct_p_value_crosses_the_level(r, v, delta):
    level = 0.05 / 16
    eps = audit.epsilon_lower_bound(1000, r, v, delta, level)
    assert eps > 0
    assert _direct_p_value(1000, r, v, eps, delta) <= level * (1 + 1e-9)  # float rounding at the crossing
    assert _direct_p_value(1000, r, v, eps + 1e-6, delta) > level


def test_delta_term_lowers_the_bound_and_chance_gives_none():
    assert audit.epsilon_lower_bound(1000, 200, 200, 1e-3, 0.05) < audit.epsilon_lower_bound(1000, 200, 200, 0.0, 0.05)
    assert audit.epsilon_lower_bound(1000, 100, 50, 1e-5, 0.05) == 0.0  # a coin's accuracy proves nothing


def test_correct_guesses_counts_top_members_and_bottom_non_members():
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    members = np.array([1, 0, 1, 0, 0, 1], dtype=bool)
    assert audit.correct_guesses(scores, members, 2, 0) == 1
    assert audit.correct_guesses(scores, members, 1, 2) == 1 + 1  # top: member; bottom two: one non-member
    assert audit.correct_guesses(scores, members, 3, 3) == 2 + 2


def test_bonferroni_family_and_p_value_of_the_reported_epsilon():
    rng = np.random.default_rng(1)
    members = rng.random(1000) < 0.5
    perfect = members.astype(float) + 0.01 * rng.random(1000)
    result = audit.audit({"white_box": perfect, "final_model": rng.random(1000)}, members, 1e-5, 0.05, 1.0)
    assert result.tests == 2 * len(audit.guess_counts(1000))
    level = 0.05 / result.tests
    assert result.observer == "white_box" and result.correct == result.guesses  # perfect scores: every guess right
    assert result.epsilon_lower_bound == pytest.approx(audit.epsilon_lower_bound(1000, result.guesses, result.correct,
                                                                                 1e-5, level))
    assert result.epsilon_lower_bound > 3
    # Perfect separation refutes epsilon = 1; the delta term (2 m delta alpha) keeps the p-value from vanishing.
    assert result.p_value_of_reported < 0.01
    assert audit.audit({"noise": rng.random(1000)}, members, 1e-5, 0.05, 1.0).p_value_of_reported > 0.05


def test_white_box_llr_is_the_mixture_likelihood_ratio():
    from scipy import stats

    x, sigma = np.array([-1.0, 0.3, 2.5]), 0.8
    probs = audit.multiplicity_probs(0.3, 2, "global")
    assert probs == pytest.approx([0.49, 0.42, 0.09])
    member = sum(p * stats.norm.pdf(x, k, sigma) for k, p in enumerate(probs))
    assert audit.white_box_llr(x, sigma, probs) == pytest.approx(np.log(member / stats.norm.pdf(x, 0, sigma)))
    assert list(audit.multiplicity_probs(0.3, 2, "per_rank")) == pytest.approx([0.7, 0.3])


def test_ideal_bound_grows_as_the_noise_falls():
    loud = audit.ideal_lower_bound(1000, 0.1, 5.0, 50, 1, "per_rank", 1e-5)
    quiet = audit.ideal_lower_bound(1000, 0.1, 0.5, 50, 1, "per_rank", 1e-5)
    assert loud < 1 < 3 < quiet
