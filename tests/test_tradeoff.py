"""The membership-inference bounds of a run (workbench/privacy/accounting/tradeoff.py) against independent
computations: the closed form of mu-GDP, the exact Neyman-Pearson test of one Poisson-subsampled Gaussian step, and
Neyman-Pearson on dp_accounting's composed pmfs read as a pair of distributions."""

import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pldlib
from scipy.stats import norm

from workbench.errors import WorkbenchError
from workbench.privacy import Accountant
from workbench.privacy.accounting.tradeoff import REPORTED_FPRS, _deltas, _grid_top, gaussian_tpr, membership_bounds, tradeoff

ALPHAS = (1e-5, 1e-3, 1e-2, 0.1, 0.5)


def neyman_pearson(pmf, alphas):
    """The most TPR at each FPR of the pair a pmf stands for (upper: mass p_i at loss l_i; lower: p_i e^-l_i), by the
    likelihood-ratio test thresholded from the largest loss down, randomised between thresholds."""
    dense = pmf.to_dense_pmf()
    losses = (np.arange(dense.size) + dense._lower_loss) * dense._discretization
    order = np.argsort(-losses)
    p = np.asarray(dense._probs)[order]
    fpr = np.concatenate([[0.0], np.cumsum(p * np.exp(-losses[order]))])
    tpr = dense._infinity_mass + np.concatenate([[0.0], np.cumsum(p)])
    return np.interp(alphas, fpr, tpr, right=1.0)


@pytest.mark.parametrize("sigma", [0.7, 1.0, 4.0])
def test_gaussian_mechanism_matches_the_gdp_closed_form(sigma):
    t = tradeoff(pldlib.from_gaussian_mechanism(sigma, value_discretization_interval=1e-3), ALPHAS)
    exact = np.array([gaussian_tpr(a, 1 / sigma) for a in ALPHAS])
    assert np.all(np.array(t.tpr) >= exact - 1e-12)  # an upper bound
    np.testing.assert_allclose(t.tpr, exact, rtol=2e-4)  # within the discretisation
    exact_advantage = 2 * norm.cdf(1 / (2 * sigma)) - 1  # TV(N(0,1), N(mu,1))
    assert exact_advantage - 1e-12 <= t.advantage <= exact_advantage + 1e-4


@pytest.mark.parametrize("q,sigma", [(0.2, 2.0), (0.01, 0.8)])
def test_one_subsampled_step_matches_the_exact_test(q, sigma):
    """One step: out = N(0, sigma^2), in = (1 - q) N(0, sigma^2) + q N(1, sigma^2); the best test saying "member"
    thresholds the output: FPR = Q(x / sigma), TPR = (1 - q) FPR + q Q((x - 1) / sigma)."""
    alphas = np.array([1e-4, 1e-3, 1e-2, 0.1])
    t = tradeoff(pldlib.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=1e-4), alphas)
    x = norm.isf(alphas) * sigma
    exact = (1 - q) * alphas + q * norm.sf((x - 1) / sigma)
    assert np.all(np.array(t.tpr) >= exact - 1e-12)
    np.testing.assert_allclose(t.tpr, exact, rtol=1e-4)


@pytest.mark.parametrize("q,sigma,steps", [(0.01, 1.0, 1000), (0.05, 0.8, 200)])
def test_composed_steps_match_neyman_pearson_on_the_pmfs(q, sigma, steps):
    """The symmetric bound from the privacy profile is at least each direction's own best test on the same pmfs, and
    at the reported FPRs equals the worse of the two (the profile loses nothing there)."""
    pld = pldlib.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=2e-4).self_compose(steps)
    alphas = np.array([*REPORTED_FPRS, 0.1, 0.3])
    t = np.array(tradeoff(pld, alphas).tpr)
    worse = np.maximum(neyman_pearson(pld._pmf_remove, alphas), neyman_pearson(pld._pmf_add, alphas))
    assert np.all(t >= worse - 1e-9)  # the add pmf's lower masses sum past 1 by ~1e-3: its own test is ~1e-11 loose
    np.testing.assert_allclose(t[:2], worse[:2], rtol=1e-6)


def test_the_upper_bound_is_above_the_optimistic_pld():
    """dp_accounting's optimistic PLD (losses rounded down) lies below the truth; ours must lie above it."""
    args = dict(standard_deviation=1.0, sampling_prob=0.02, value_discretization_interval=1e-3)
    hi = tradeoff(pldlib.from_gaussian_mechanism(**args, pessimistic_estimate=True).self_compose(300), ALPHAS)
    lo = tradeoff(pldlib.from_gaussian_mechanism(**args, pessimistic_estimate=False).self_compose(300), ALPHAS)
    assert np.all(np.array(hi.tpr) >= np.array(lo.tpr)) and hi.advantage >= lo.advantage
    assert hi.tpr[1] > lo.tpr[1]  # the two differ: the comparison can fail


def test_the_sup_over_epsilon_is_exact_between_grid_points():
    """Refining eps between the loss grid's points (dp_accounting's own deltas) never finds a larger f."""
    pld = pldlib.from_gaussian_mechanism(1.5, sampling_prob=0.1, value_discretization_interval=1e-2).self_compose(20)
    eps = np.linspace(0, 12, 12 * 100 * 7 + 1)  # 7 points per grid step
    delta = np.asarray(pld.get_delta_for_epsilon(eps))
    for a in ALPHAS:
        f = np.maximum(1 - delta - np.exp(eps) * a, np.exp(-eps) * (1 - delta - a)).max()
        assert tradeoff(pld, [a]).tpr[0] >= 1 - max(f, 0) - 1e-12


def test_deltas_equal_dp_accounting():
    pld = pldlib.from_gaussian_mechanism(1.0, sampling_prob=0.01, value_discretization_interval=2e-4).self_compose(500)
    for pmf in (pld._pmf_remove, pld._pmf_add):
        top = _grid_top(pmf)
        eps = np.arange(top + 1) * 2e-4
        np.testing.assert_allclose(_deltas(pmf, top), pmf.get_delta_for_epsilon(eps), rtol=0, atol=1e-13)


def _bounds_in_50_digits(pld, alphas):
    """The bound's formula (module docstring) on the same pmfs in 50-digit arithmetic, where e^eps never overflows:
    delta(k d) for k = 0..the largest finite loss, the worse direction, then the sup over the grid."""
    import mpmath

    mpmath.mp.dps = 50
    sides = []
    for pmf in [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]:
        dense = pmf.to_dense_pmf()
        losses = [(i + dense._lower_loss) * dense._discretization for i in range(dense.size)]
        sides.append((losses, [mpmath.mpf(float(p)) for p in dense._probs], mpmath.mpf(dense._infinity_mass),
                      dense._discretization))
    d = sides[0][3]
    top = max(round(max([l for l, p in zip(ls, ps) if p > 0 and l > 0], default=0) / d) for ls, ps, _, _ in sides)
    deltas = [mpmath.mpf(0)] * (top + 1)
    for losses, probs, inf_mass, _ in sides:
        upper, lower, i = mpmath.mpf(0), mpmath.mpf(0), len(losses) - 1
        for k in range(top, -1, -1):  # suffix sums over losses > k d, from the top down
            while i >= 0 and losses[i] > k * d + 1e-9 * d:
                upper += probs[i]
                lower += probs[i] * mpmath.exp(-mpmath.mpf(losses[i]))
                i -= 1
            deltas[k] = max(deltas[k], min(max(inf_mass + upper - mpmath.exp(k * d) * lower, 0), 1))
    out = []
    for a in alphas:
        a = mpmath.mpf(a)
        f = max(max(1 - dk - mpmath.exp(k * d) * a, mpmath.exp(-k * d) * (1 - dk - a)) for k, dk in enumerate(deltas))
        out.append(float(min(max(1 - max(f, 0), a), 1)))
    return np.array(out)


SIGMAS = (0.02, 0.05, 0.1, 0.3, 1.0, 3.0, 30.0)


def test_the_bounds_are_finite_for_every_sigma_and_tend_to_their_limit():
    """From tiny sigma (losses past 700, where e^eps overflows float64) to large: every bound finite, in [alpha, 1],
    falling as sigma grows, equal to the same formula in 50-digit arithmetic, and at tiny sigma equal to its limit
    min(1, alpha + c), c = 1 - (1 - q)^T the chance that the example is ever drawn (the module docstring's derivation).
    """
    q, steps, alphas = 0.1, 5, np.array(REPORTED_FPRS)
    limit = np.minimum(1, alphas + 1 - (1 - q) ** steps)
    previous = np.ones(len(alphas))
    for sigma in SIGMAS:
        pld = Accountant("pld", q, sigma, pld_discretization=0.05).pld(steps)
        t = tradeoff(pld, alphas)
        tpr = np.array(t.tpr)
        assert np.all(np.isfinite(tpr)) and math.isfinite(t.advantage), sigma
        assert np.all((tpr >= alphas) & (tpr <= 1)) and np.all(tpr <= previous + 1e-12), sigma
        previous = tpr
        if sigma in (0.05, 0.3, 3.0):  # the float64 sup against exact arithmetic on the same pmfs
            np.testing.assert_allclose(tpr, _bounds_in_50_digits(pld, alphas), rtol=0, atol=1e-12)
        if sigma <= 0.05:  # each draw all but certainly tells; the pessimistic rounding adds under 1e-9 here
            assert np.all(tpr >= limit - 1e-12) and np.all(tpr <= limit + 1e-9), sigma
    assert previous[0] < 2 * alphas[0]  # sigma 30: next to guessing, so the limit checked above is not the only value


def test_a_run_that_draws_every_example_tends_to_a_bound_of_one():
    """Many steps at tiny sigma: c = 1 - (1 - q)^T is 1 in float64, so the bounds are 1 (the non-private limit), not
    NaN; and the unsampled Gaussian (blt's event: every example drawn) at mu = 20 is 1 as its closed form is."""
    pld = Accountant("pld", 0.2, 0.05, pld_discretization=0.1).pld(200)
    assert tradeoff(pld, REPORTED_FPRS).metrics() == {"mia_tpr_at_fpr_0.001": 1.0, "mia_tpr_at_fpr_0.01": 1.0,
                                                       "mia_advantage": 1.0}
    t = tradeoff(pldlib.from_gaussian_mechanism(0.05, value_discretization_interval=1e-2).self_compose(3), ALPHAS)
    exact = [gaussian_tpr(a, math.sqrt(3) / 0.05) for a in ALPHAS]
    assert exact == [1.0] * len(ALPHAS) and list(t.tpr) == exact


def test_run_bounds_from_the_accountant(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    few, many = (membership_bounds(Accountant("pld", 0.01, 1.0), s) for s in (100, 1000))
    assert set(many.metrics()) == {"mia_tpr_at_fpr_0.001", "mia_tpr_at_fpr_0.01", "mia_advantage"}
    assert all(many.metrics()[k] > few.metrics()[k] for k in many.metrics())  # more steps: more to gain
    assert 0.001 < many.metrics()["mia_tpr_at_fpr_0.001"] < many.metrics()["mia_tpr_at_fpr_0.01"] < 1
    # rdp and prv runs are bounded from the PLD of the same event
    assert membership_bounds(Accountant("rdp", 0.01, 1.0), 1000).metrics() == pytest.approx(many.metrics(), rel=1e-12)
    none = membership_bounds(Accountant("pld", 0.01, 1.0), 0)
    assert none.advantage == 0 and np.allclose(none.tpr, none.fpr)  # nothing released: guessing


def test_bad_input_is_refused_in_one_line():
    pld = pldlib.from_gaussian_mechanism(1.0, value_discretization_interval=1e-2)
    for bad in ([], [1.5], [-0.1], [[0.1]]):
        with pytest.raises(WorkbenchError, match="fpr must be"):
            tradeoff(pld, bad)
    with pytest.raises(WorkbenchError, match="non-private"):
        membership_bounds(Accountant("pld", 0.01, 0.0), 10)
    assert math.isclose(gaussian_tpr(0.0, 1.0), 0.0)


def test_a_private_run_logs_its_bounds_and_draws_the_curve(make_cfg, mlflow_uri, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from workbench import train

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    result = train(make_cfg("experiment=quick", "max_steps=6"))
    run = MlflowClient(tracking_uri=mlflow_uri).get_run(result.run_id)
    metrics = run.data.metrics
    expected = membership_bounds(Accountant("pld", result.sample_rate, result.noise_multiplier), result.steps).metrics()
    assert {k: metrics[k] for k in expected} == pytest.approx(expected, rel=1e-12)
    assert 0.001 < metrics["mia_tpr_at_fpr_0.001"] <= metrics["mia_tpr_at_fpr_0.01"] <= 1
    names = {a.path for a in MlflowClient(tracking_uri=mlflow_uri).list_artifacts(result.run_id)}
    assert {"training_curves.png", "privacy_tradeoff.png"} <= names


def test_a_non_private_run_has_no_bounds(make_cfg, mlflow_uri):
    from mlflow import MlflowClient

    from workbench import train

    result = train(make_cfg("experiment=quick", "max_steps=2", "privacy=none"))
    run = MlflowClient(tracking_uri=mlflow_uri).get_run(result.run_id)
    assert not any(k.startswith("mia_") for k in run.data.metrics)
    assert "privacy_tradeoff.png" not in {a.path for a in MlflowClient(tracking_uri=mlflow_uri).list_artifacts(result.run_id)}


def test_the_tradeoff_picture_is_drawn_from_what_the_tracker_carries():
    import json

    from workbench.plots import FIGURES

    t = tradeoff(pldlib.from_gaussian_mechanism(1.0, value_discretization_interval=1e-2))
    # what tracker.log_plot carries to the worker: JSON-safe data (it may be spooled)
    payload = json.loads(json.dumps({"fpr": list(t.fpr), "tpr": list(t.tpr), "epsilon": 2.0, "delta": 1e-5,
                                     "advantage": t.advantage}))
    fig = FIGURES["privacy_tradeoff"](**payload)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and "membership" in ax.get_title()
    drawn = ax.lines[0].get_ydata()
    assert len(drawn) == sum(a > 0 for a in t.fpr) and max(drawn) <= 1
