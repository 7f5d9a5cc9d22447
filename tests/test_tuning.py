"""The privacy cost of a sweep (workbench/privacy/accounting/tuning.py): every run composed, as dp_accounting composes
it; and the bounds for publishing only the best of a random number of trials (Papernot & Steinke 2022: Theorems 2 and
6 on worked examples and against dp_accounting's RepeatAndSelectDpEvent; the privacy-profile bound next to them)."""

import math

import dp_accounting
import pytest
from scipy.stats import norm

from workbench.privacy import Accountant
from workbench.privacy.accounting import tuning


def test_sweep_epsilon_all_is_dp_accountings_composition_of_mixed_events():
    runs = [(Accountant("pld", 0.02, 1.1), 300), (Accountant("pld", 0.05, 2.0), 100),
            (Accountant("pld", 0.01, 3.0, world_size=2, shard="global"), 200)]
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=2e-4)
    for a, steps in runs:
        acc.compose(a.event(steps))  # the Poisson and the parallel-Poisson (mixture of Gaussians) events
    assert tuning.composed_epsilon(runs, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=0.01)
    assert tuning.composed_epsilon(runs[:1], 1e-5) == pytest.approx(runs[0][0].epsilon(300, 1e-5), rel=1e-9)


def _gaussian_rdp(order, sigma):
    return order / (2 * sigma**2)  # the Gaussian mechanism, sensitivity 1 (Mironov 2017)


def _rdp_to_dp(orders, rdp, delta):
    """Canonne, Kamath & Steinke 2020, Prop. 12: eps = rdp + log((a-1)/a) - (log delta + log a) / (a-1)."""
    return min(r + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1) for a, r in zip(orders, rdp))


def test_random_stopping_truncated_negative_binomial_is_theorem_2_on_a_worked_example():
    # One trial: a Gaussian mechanism (q = 1, one step) with sigma = 4. K ~ D_{eta=1, gamma=0.1}, the geometric
    # distribution: E[K] = 1 / gamma = 10 trials.
    sigma, eta, gamma, delta = 4.0, 1.0, 0.1, 1e-6
    assert tuning.expected_trials("truncated_negative_binomial", eta=eta, gamma=gamma) == pytest.approx(10.0)
    orders = [1 + x / 10 for x in range(1, 100)] + list(range(11, 64))
    hat = min([(1 + eta) * math.log(1 / gamma)]
              + [(1 + eta) * (1 - 1 / a) * _gaussian_rdp(a, sigma) + (1 + eta) * math.log(1 / gamma) / a for a in orders])
    tuned = [_gaussian_rdp(a, sigma) + hat + math.log(10.0) / (a - 1) for a in orders]
    expected = _rdp_to_dp(orders, tuned, delta)
    got = tuning.random_stopping_epsilon([(Accountant("pld", 1.0, sigma), 1)], delta, "truncated_negative_binomial",
                                        eta=eta, gamma=gamma, orders=orders)
    assert got == pytest.approx(expected, rel=1e-6)
    one_run = Accountant("rdp", 1.0, sigma).epsilon(1, delta)
    assert one_run < got < 10 * one_run  # tuning costs more than one run, far less than composing E[K] of them


def test_random_stopping_poisson_is_theorem_6_on_a_worked_example():
    sigma, mu, delta = 4.0, 5.0, 1e-6
    orders = [1 + x / 10 for x in range(1, 100)] + list(range(11, 64))

    def gaussian_delta(eps):  # the exact Gaussian privacy profile (Balle & Wang 2018)
        return norm.cdf(1 / (2 * sigma) - eps * sigma) - math.exp(eps) * norm.cdf(-1 / (2 * sigma) - eps * sigma)

    tuned = [_gaussian_rdp(a, sigma) + mu * gaussian_delta(math.log1p(1 / (a - 1))) + math.log(mu) / (a - 1)
             for a in orders]
    got = tuning.random_stopping_epsilon([(Accountant("pld", 1.0, sigma), 1)], delta, "poisson", poisson_mean=mu,
                                        orders=orders)
    assert got == pytest.approx(_rdp_to_dp(orders, tuned, delta), rel=1e-3)  # delta_hat from the (pessimistic) PLD


def test_random_stopping_rdp_bound_is_dp_accountings_repeat_and_select():
    # dp_accounting's own implementation of Theorems 2 and 6 (RepeatAndSelectDpEvent) on the same base mechanism
    from dp_accounting.rdp import RdpAccountant

    base = Accountant("pld", 0.02, 1.1)
    orders = list(tuning.ORDERS)
    for eta, gamma in ((1.0, 0.1), (0.5, 0.3), (0.0, 0.2)):
        mean = tuning.expected_trials("truncated_negative_binomial", eta=eta, gamma=gamma)
        theirs = RdpAccountant(orders=orders).compose(
            dp_accounting.dp_event.RepeatAndSelectDpEvent(base.event(300), mean, eta)).get_epsilon(1e-5)
        ours = tuning.random_stopping_epsilon([(base, 300)], 1e-5, "truncated_negative_binomial", eta=eta, gamma=gamma)
        assert ours == pytest.approx(theirs, rel=2e-3)  # theirs inverts the mean to gamma numerically
    theirs = RdpAccountant(orders=orders).compose(
        dp_accounting.dp_event.RepeatAndSelectDpEvent(base.event(300), 3.0, math.inf)).get_epsilon(1e-5)
    ours = tuning.random_stopping_epsilon([(base, 300)], 1e-5, "poisson", poisson_mean=3.0)
    # Theorem 6 with delta_hat from the PLD (ours) rather than from the RDP curve (theirs): the same form, tighter
    assert base.epsilon(300, 1e-5) < ours <= theirs * 1.001


@pytest.mark.parametrize("trials", ["poisson", "truncated_negative_binomial"])
def test_the_profile_bound_beats_rdp_on_dp_sgd_and_stays_above_one_run(trials):
    runs = [(Accountant("pld", 0.02, 1.0), 300), (Accountant("pld", 0.01, 0.8), 1000)]
    args = (1e-5, trials, 3.0, 0.0, 0.1)
    profile, rdp = tuning.profile_epsilon(runs, *args), tuning.random_stopping_epsilon(runs, *args)
    worst = max(a.epsilon(n, 1e-5) for a, n in runs)
    assert worst < profile < rdp
    # the worst candidate decides: dropping the milder one changes nothing, dropping the worst lowers the bound
    assert tuning.profile_epsilon(runs[1:], *args) == pytest.approx(profile, rel=1e-9)
    assert tuning.profile_epsilon(runs[:1], *args) < profile - 0.5


def test_a_candidate_without_noise_or_steps_never_crashes_the_bound():
    runs = [(Accountant("pld", 0.02, 1.0), 300)]
    args = (1e-5, "poisson", 3.0)
    assert tuning.profile_epsilon([*runs, (Accountant("pld", 0.02, 0.0), 10)], *args) == math.inf
    assert tuning.random_stopping_epsilon([*runs, (Accountant("pld", 0.02, 0.0), 10)], *args) == math.inf
    assert tuning.profile_epsilon([*runs, (Accountant("pld", 0.5, 0.3), 0)], *args) == tuning.profile_epsilon(runs, *args)
    assert tuning.random_stopping_epsilon([(Accountant("pld", 0.5, 0.3), 0)], *args) == 0.0  # never reads the data


def test_the_sweep_cost_math_keeps_its_old_import_path():
    """It moved from the sweep module to the privacy package; notebooks call it as ``sweep.random_stopping_epsilon``."""
    from workbench import sweep
    from workbench.privacy.accounting import tuning

    for name in ("composed_epsilon", "expected_trials", "profile_epsilon", "random_stopping_epsilon"):
        assert getattr(sweep, name) is getattr(tuning, name)
