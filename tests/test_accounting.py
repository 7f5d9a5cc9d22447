"""The accounting (workbench/privacy/accounting/): epsilon agrees with dp_accounting computed directly here, calibration
never overshoots, budgets are consistent, errors are one clear WorkbenchError."""

import io
import math

import dp_accounting
import pytest
import torch
from dp_accounting.dp_event import MixtureOfGaussiansDpEvent
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

from workbench import privacy
from workbench.errors import WorkbenchError

DELTA = 1e-5
REL = 1e-9  # "equal": the same computation, allowing for last-bit differences between numpy code paths


def direct_poisson_pld(q, sigma, steps, delta, d):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return PLDAccountant(value_discretization_interval=d).compose(event).get_epsilon(delta)


def direct_poisson_rdp(q, sigma, steps, delta):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return RdpAccountant().compose(event).get_epsilon(delta)


def direct_parallel_poisson_pld(q_r, sigma, world_size, steps, delta, d):
    """W ranks each Poisson-sample every example at q_r: multiplicity K ~ Binomial(W, q_r), sensitivity K."""
    probs = [math.comb(world_size, k) * q_r**k * (1 - q_r) ** (world_size - k) for k in range(world_size + 1)]
    event = dp_accounting.SelfComposedDpEvent(
        MixtureOfGaussiansDpEvent(sigma, list(range(world_size + 1)), probs), steps)
    return PLDAccountant(value_discretization_interval=d).compose(event).get_epsilon(delta)


# ------------------------------------------------------------------------------------ agreement with dp_accounting


@pytest.mark.parametrize("q, sigma, steps", [(0.01, 1.0, 1000), (256 / 1437, 1.1, 60), (0.001, 0.8, 20000),
                                             (1.0, 5.0, 10)])
def test_pld_epsilon_equals_direct_dp_accounting(q, sigma, steps):
    acc = privacy.Accountant("pld", q, sigma)
    expected = direct_poisson_pld(q, sigma, steps, DELTA, privacy.DEFAULT_PLD_DISCRETIZATION)
    assert acc.epsilon(steps, DELTA) == pytest.approx(expected, rel=REL)
    coarse = privacy.Accountant("pld", q, sigma, pld_discretization=1e-3)
    assert coarse.epsilon(steps, DELTA) == pytest.approx(direct_poisson_pld(q, sigma, steps, DELTA, 1e-3), rel=REL)


@pytest.mark.parametrize("q, sigma, steps", [(0.01, 1.0, 1000), (256 / 1437, 1.1, 60), (0.001, 0.8, 20000)])
def test_rdp_epsilon_equals_direct_dp_accounting(q, sigma, steps):
    acc = privacy.Accountant("rdp", q, sigma)
    assert acc.epsilon(steps, DELTA) == pytest.approx(direct_poisson_rdp(q, sigma, steps, DELTA), rel=REL)


@pytest.mark.parametrize("q, sigma, steps", [(0.001, 0.8, 20000), (256 / 1437, 1.5, 100), (0.05, 2.0, 500)])
def test_prv_close_to_pld_and_rdp_looser(q, sigma, steps):
    pld = privacy.Accountant("pld", q, sigma).epsilon(steps, DELTA)
    prv = privacy.Accountant("prv", q, sigma).epsilon(steps, DELTA)
    rdp = privacy.Accountant("rdp", q, sigma).epsilon(steps, DELTA)
    assert prv == pytest.approx(pld, rel=0.01, abs=0.03)
    assert pld <= prv + 0.005  # pld (default) is the tightest: PRV reports an upper bound within eps_error=0.01
    assert pld < rdp


# ----------------------------------------------------------------------------------------- parallel Poisson


def test_global_with_one_rank_is_poisson_exactly():
    assert privacy.dp_event(0.05, 1.2, 300, 1, "global") == privacy.dp_event(0.05, 1.2, 300, 1, "per_rank")
    for kind in ("pld", "rdp", "prv"):
        a = privacy.Accountant(kind, 0.05, 1.2, 1, "global").epsilon(300, DELTA)
        b = privacy.Accountant(kind, 0.05, 1.2, 1, "per_rank").epsilon(300, DELTA)
        assert a == b, kind


def test_mixture_event_with_one_rank_matches_poisson():
    """The mixture formulation itself reduces to Poisson at W=1 (up to dp_accounting's numerical inversion)."""
    d = 2e-3
    mixture = direct_parallel_poisson_pld(0.05, 2.0, 1, 100, DELTA, d)
    assert mixture == pytest.approx(direct_poisson_pld(0.05, 2.0, 100, DELTA, d), rel=1e-4)


@pytest.mark.parametrize("world_size, sigma, d", [(2, 2.0, 2e-3), (3, 3.0, 2e-3)])
def test_global_equals_direct_mixture_of_gaussians(world_size, sigma, d):
    q_r, steps = 0.05, 100
    acc = privacy.Accountant("pld", q_r, sigma, world_size, "global", pld_discretization=d)
    expected = direct_parallel_poisson_pld(q_r, sigma, world_size, steps, DELTA, d)
    assert acc.epsilon(steps, DELTA) == pytest.approx(expected, rel=REL)


def test_dp_event_shapes():
    e = privacy.dp_event(0.1, 1.0, 7, 3, "global")
    assert isinstance(e, dp_accounting.SelfComposedDpEvent) and e.count == 7
    assert isinstance(e.event, MixtureOfGaussiansDpEvent)
    assert list(e.event.sensitivities) == [0, 1, 2, 3]
    assert sum(e.event.sampling_probs) == pytest.approx(1.0)
    assert e.event.sampling_probs[3] == pytest.approx(0.1**3)
    p = privacy.dp_event(0.1, 1.0, 7)
    assert p == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), 7)


def test_global_sanity_ordering():
    """Numerical sanity, with margins: more ranks means a larger multiplicity, which reveals more. K ~ Binomial(W, q_r)
    is a mean-preserving spread of Bernoulli(W q_r) and stochastically dominates Bernoulli(q_r); we observe (and
    assert only) per_rank(q_r) < per_rank(W q_r) <= global(W, q_r), global finite and increasing in W."""
    q_r, sigma, steps, d = 0.03, 1.5, 200, 1e-3

    def eps(q, w=1):
        return privacy.Accountant("pld", q, sigma, w, "global", pld_discretization=d).epsilon(steps, DELTA)

    per_rank = eps(q_r)
    previous = per_rank
    for w in (2, 3):
        g = eps(q_r, w)
        assert math.isfinite(g)
        assert per_rank < eps(w * q_r) <= g
        assert g > previous
        previous = g


# ---------------------------------------------------------------------------------------------- calibration


@pytest.mark.parametrize("q, steps", [(256 / 1437, 60), (0.01, 2000)])
@pytest.mark.parametrize("target", [1.0, 3.0, 8.0])
def test_calibrate_noise_never_overshoots_and_is_tight(q, steps, target):
    sigma = privacy.calibrate_noise("pld", q, steps, target, DELTA)
    assert privacy.Accountant("pld", q, sigma).epsilon(steps, DELTA) <= target
    assert sigma == privacy.SIGMA_MIN or privacy.Accountant("pld", q, sigma * 0.98).epsilon(steps, DELTA) > target


@pytest.mark.parametrize("kind", ["rdp", "prv"])
def test_calibrate_noise_uses_the_same_accountant(kind):
    q, steps, target = 0.05, 300, 2.0
    sigma = privacy.calibrate_noise(kind, q, steps, target, DELTA)
    assert privacy.Accountant(kind, q, sigma).epsilon(steps, DELTA) <= target
    assert privacy.Accountant(kind, q, sigma * 0.98).epsilon(steps, DELTA) > target


def test_calibrate_noise_global():
    q_r, steps, target, w, d = 0.02, 100, 3.0, 3, 1e-3
    sigma = privacy.calibrate_noise("pld", q_r, steps, target, DELTA, w, "global", pld_discretization=d)
    assert direct_parallel_poisson_pld(q_r, sigma, w, steps, DELTA, d) <= target  # stock dp_accounting agrees
    tighter = privacy.Accountant("pld", q_r, sigma * 0.98, w, "global", pld_discretization=d)
    assert tighter.epsilon(steps, DELTA) > target
    # more ranks sampling the same examples need more noise
    assert sigma > privacy.calibrate_noise("pld", q_r, steps, target, DELTA, pld_discretization=d)


def test_calibrate_noise_passes_discretization_through():
    sigma = privacy.calibrate_noise("pld", 0.05, 100, 2.0, DELTA, pld_discretization=1e-3)
    assert direct_poisson_pld(0.05, sigma, 100, DELTA, 1e-3) <= 2.0


def test_calibrate_noise_returns_lower_bracket_when_it_suffices():
    assert privacy.calibrate_noise("pld", 0.01, 1, 1000.0, DELTA) == privacy.SIGMA_MIN


def test_calibrate_noise_unreachable_target():
    with pytest.raises(WorkbenchError, match=r"target_epsilon=1e-06 is unreachable.*noise_multiplier=1000.*epsilon="):
        privacy.calibrate_noise("pld", 0.5, 1000, 1e-6, DELTA)


# ----------------------------------------------------------------------------------------- budget / ledger


def test_epsilon_basics():
    acc = privacy.Accountant("pld", 0.05, 1.0)
    assert acc.epsilon(0, DELTA) == 0.0
    e = acc.epsilon(100, DELTA)
    assert 0 < e < math.inf and acc.epsilon(100, DELTA) == e  # cached
    assert acc.epsilon(200, DELTA) > e
    assert acc.epsilon(100, 1e-3) < e
    assert privacy.Accountant("pld", 0.05, 0.0).epsilon(1, DELTA) == math.inf
    acc.step()
    acc.step(4)
    assert acc.steps == 5


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_max_steps_consistent_with_epsilon(kind):
    acc = privacy.Accountant(kind, 0.05, 1.5)
    targets = [1.0, 2.0, 4.0, 8.0]
    budgets = [acc.max_steps(t, DELTA, 2000) for t in targets]
    assert budgets == sorted(budgets) and budgets[0] < budgets[-1]
    for t, m in zip(targets, budgets):
        assert 0 < m < 2000
        assert acc.epsilon(m, DELTA) <= t < acc.epsilon(m + 1, DELTA)
    assert acc.max_steps(1e-4, DELTA, 2000) == 0  # even one step exceeds
    assert acc.max_steps(100.0, DELTA, 2000) == 2000  # the cap binds
    assert acc.max_steps(1.0, DELTA, 0) == 0


def test_state_dict_round_trip_through_torch_save():
    acc = privacy.Accountant("pld", 0.05, 1.3, 2, "global", pld_discretization=1e-3)
    acc.step(17)
    state = acc.state_dict()
    assert set(state) == {"kind", "sample_rate", "noise_multiplier", "world_size", "shard", "pld_discretization",
                          "steps"}
    assert all(type(v) in (str, int, float) for v in state.values())
    buf = io.BytesIO()
    torch.save({"accountant": state}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["accountant"]
    assert loaded == state

    fresh = privacy.Accountant("pld", 0.05, 1.3, 2, "global", pld_discretization=1e-3)
    fresh.load_state_dict(loaded)
    assert fresh.steps == 17 and fresh.state_dict() == state
    rebuilt = privacy.Accountant.from_state_dict(loaded)
    assert rebuilt.state_dict() == state
    assert rebuilt.epsilon(17, DELTA) == acc.epsilon(17, DELTA)


def test_load_state_dict_refuses_a_different_mechanism():
    acc = privacy.Accountant("pld", 0.05, 1.3)
    other = privacy.Accountant("pld", 0.05, 1.4).state_dict()
    with pytest.raises(WorkbenchError, match="noise_multiplier"):
        acc.load_state_dict(other)
    with pytest.raises(WorkbenchError, match="missing steps"):
        acc.load_state_dict({k: v for k, v in acc.state_dict().items() if k != "steps"})


# --------------------------------------------------------------------------------------------------- errors


def test_unknown_accountant_kind():
    with pytest.raises(WorkbenchError, match="accountant 'gdp' is unknown"):
        privacy.Accountant("gdp", 0.1, 1.0)
    with pytest.raises(WorkbenchError, match="accountant 'gdp' is unknown"):
        privacy.calibrate_noise("gdp", 0.1, 10, 1.0, DELTA)


@pytest.mark.parametrize("kind", ["rdp", "prv"])
def test_global_needs_pld(kind):
    with pytest.raises(WorkbenchError, match=f"accountant '{kind}' does not support shard=global.*accountant=pld"):
        privacy.Accountant(kind, 0.1, 1.0, 2, "global")
    with pytest.raises(WorkbenchError, match="does not support shard=global"):
        privacy.calibrate_noise(kind, 0.1, 10, 1.0, DELTA, 2, "global")


def test_bad_mechanism_arguments():
    with pytest.raises(WorkbenchError, match="shard='both'"):
        privacy.Accountant("pld", 0.1, 1.0, 2, "both")
    with pytest.raises(WorkbenchError, match="sample_rate"):
        privacy.Accountant("pld", 0.0, 1.0)
    with pytest.raises(WorkbenchError, match="sample_rate"):
        privacy.Accountant("pld", 1.5, 1.0)
    with pytest.raises(WorkbenchError, match="noise_multiplier"):
        privacy.Accountant("pld", 0.1, -1.0)
    with pytest.raises(WorkbenchError, match="world_size"):
        privacy.Accountant("pld", 0.1, 1.0, 0)
    with pytest.raises(WorkbenchError, match="delta"):
        privacy.Accountant("pld", 0.1, 1.0).epsilon(10, 1.0)
    with pytest.raises(WorkbenchError, match="target_epsilon"):
        privacy.calibrate_noise("pld", 0.1, 10, 0.0, DELTA)


@pytest.mark.parametrize("kwargs, bad", [
    (dict(target_epsilon=0.0), "target_epsilon"),
    (dict(target_epsilon=-1.0), "target_epsilon"),
    (dict(delta=1.0), "delta"),
    (dict(delta=0.0), "delta"),
    (dict(delta=1.5), "delta"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"),
    (dict(noise_multiplier=-0.5), "noise_multiplier"),
])
def test_validate_privacy_args_errors(kwargs, bad):
    args = dict(target_epsilon=3.0, delta=1e-5, noise_multiplier=None, max_grad_norm=1.0, dataset_size=1437)
    args.update(kwargs)
    with pytest.raises(WorkbenchError, match=bad) as info:
        privacy.validate_privacy_args(**args)
    assert "\n" not in str(info.value)


def test_validate_privacy_args_warnings():
    assert privacy.validate_privacy_args(3.0, 1e-5, None, 1.0, 1437) == []
    assert privacy.validate_privacy_args(None, None, 1.0, 1.0, 1437) == []
    (warning,) = privacy.validate_privacy_args(3.0, 1e-3, None, 1.0, 1437)
    assert "delta=0.001" in warning and "1/N" in warning and "1437" in warning


def test_default_delta_is_below_one_over_n():
    assert privacy.default_delta(1437) == 1e-5
    assert privacy.default_delta(60000) == 1e-6
    assert privacy.default_delta(10) == 1e-5
    for n in (1, 9, 10, 11, 99999, 100000, 100001, 10**7):
        assert privacy.default_delta(n) < 1 / n
    with pytest.raises(WorkbenchError, match="dataset_size"):
        privacy.default_delta(0)


# ------------------------------------------------------------------------------------ the epsilon schedule


def test_epsilon_schedule_gives_every_logging_step_its_own_epsilon():
    from workbench.privacy.accounting.accountant import LINE_SLACK
    from workbench.trainer import logging_steps

    q, sigma = 256 / 1437, 1.6
    steps = logging_steps(0, 57, 10)
    assert steps == [10, 20, 30, 40, 50, 57]
    schedule = privacy.EpsilonSchedule(privacy.Accountant("pld", q, sigma), DELTA, steps)
    values = [schedule.get(s) for s in steps]  # waits for each
    fresh = [direct_poisson_pld(q, sigma, s, DELTA, privacy.DEFAULT_PLD_DISCRETIZATION) for s in steps]
    assert values[-1] == pytest.approx(fresh[-1], rel=REL)  # the reported epsilon: a fresh computation
    # the lines before: never under a fresh computation, at most LINE_SLACK above it (a coarser grid, when one is close)
    assert all(f * (1 - REL) <= v <= f * (1 + LINE_SLACK) for v, f in zip(values, fresh))
    assert values == sorted(values)
    assert schedule.latest(35) == (30, values[2]) and schedule.latest(57) == (57, values[-1])
    assert schedule.latest(5) is None
    assert schedule.get(3) == pytest.approx(direct_poisson_pld(q, sigma, 3, DELTA, privacy.DEFAULT_PLD_DISCRETIZATION),
                                            rel=REL)  # off the schedule: computed on demand
    assert schedule.get(4, wait=False) is None
    assert logging_steps(50, 57, 10) == [57] and logging_steps(20, 40, 10) == [30, 40]




@pytest.mark.parametrize("q, sigma, world_size, shard, d", [
    (256 / 1437, 4.75, 1, "per_rank", 2e-4),    # dense PMF, the default grid
    (256 / 1437, 4.75, 1, "per_rank", 3.2e-3),  # sparse PMF (a schedule's coarse grid): made dense past size ** n > 1000
    (0.02, 1.0, 2, "global", 1e-3),             # parallel Poisson's mixture: remove and add sides differ
])
def test_step_pld_self_composes_bit_for_bit_as_dp_accounting(q, sigma, world_size, shard, d):
    """StepPLD keeps the step's truncation bounds between compositions: every PMF it composes must be dp_accounting's
    own self_compose, bit for bit (bounds, FFT, infinity mass), and so every epsilon."""
    import numpy as np

    from workbench.privacy.accounting.events import _step_event
    from workbench.privacy.accounting.pld import StepPLD, _step_pld

    step = _step_pld(_step_event(q, sigma, world_size, shard), d)
    fast = StepPLD(step)
    for n in (1, 2, 3, 40, 7, 1000):  # not in order: the kept bounds serve any n
        ours, theirs = fast.self_compose(n), step.self_compose(n)
        assert ours._symmetric == theirs._symmetric
        for a, b in ((ours._pmf_remove, theirs._pmf_remove), (ours._pmf_add, theirs._pmf_add)):
            assert type(a) is type(b) and a._infinity_mass == b._infinity_mass
            if hasattr(b, "_probs"):
                assert a._lower_loss == b._lower_loss and np.array_equal(a._probs, b._probs)
            else:
                assert a._loss_probs == b._loss_probs
        assert ours.get_epsilon_for_delta(DELTA) == theirs.get_epsilon_for_delta(DELTA)


class _CountingAccountant:
    """A stand-in ledger whose epsilon is sqrt(step) (this tests the schedule's own bookkeeping, not accounting)."""

    def __init__(self):
        self.asked: list[int] = []

    def epsilon(self, steps, delta, on_disk=False):
        self.asked.append(steps)
        return steps ** 0.5


def test_a_long_schedule_composes_at_most_exact_lines_times_and_never_under_reports():
    """10,000 logged lines: at most EXACT_LINES compositions, each line's value the epsilon of the next exact step
    (>= its own, equal at the exact steps and the last), monotone, and the first lines exact (dense early)."""
    from workbench.privacy.accounting.accountant import EXACT_LINES, EpsilonSchedule

    ledger = _CountingAccountant()
    steps = list(range(10, 100_001, 10))
    schedule = EpsilonSchedule(ledger, 1e-5, steps)
    values = [schedule.get(s) for s in steps]
    assert len(ledger.asked) <= EXACT_LINES and ledger.asked[0] == steps[-1]  # the last first: it bounds every line
    assert ledger.asked[1:] == sorted(set(ledger.asked[1:])) and steps[-1] not in ledger.asked[1:]
    assert all(v >= s ** 0.5 for s, v in zip(steps, values))
    assert values == sorted(values) and values[-1] == steps[-1] ** 0.5
    assert all(values[i] == steps[i] ** 0.5 for i in range(3))  # the first lines are exact steps
    assert {s for s, v in zip(steps, values) if v == s ** 0.5} == set(ledger.asked)
    assert max(v / s ** 0.5 for s, v in zip(steps, values)) < 1.1  # geometric spacing: within 10 % in sqrt(step)
    assert schedule.latest(steps[-1]) == (steps[-1], steps[-1] ** 0.5)


def test_the_lines_grid_is_the_coarsest_within_the_slack_at_the_last_step_and_bounds_dp_accounting():
    """A long schedule's lines before the last are composed on a coarser PLD grid only where that costs at most
    LINE_SLACK at the last step (large epsilon: the grid's looseness is small against it); at small epsilon (the looseness is an absolute
    amount) the run's own grid is kept. Every line stays an upper bound: checked against dp_accounting's PLD on a fine
    grid, and its RDP."""
    from workbench.privacy.accounting.accountant import LINE_SLACK, EpsilonSchedule

    for q, sigma, every, lines, coarse in ((0.05, 1.0, 10, 200, True), (1e-3, 1.37, 200, 70, False)):
        steps = list(range(every, every * lines + 1, every))
        ledger = privacy.Accountant("pld", q, sigma)
        schedule = EpsilonSchedule(ledger, DELTA, steps)
        values = [schedule.get(s) for s in steps]
        grid = schedule.lines_accountant(values[-1])
        assert (grid.pld_discretization > ledger.pld_discretization) is coarse
        assert grid.epsilon(steps[-1], DELTA) <= values[-1] * (1 + LINE_SLACK)
        for s in schedule.exact[:-1][::9]:
            pld = dp_accounting.pld.privacy_loss_distribution
            below = pld.from_gaussian_mechanism(sigma, sampling_prob=q, pessimistic_estimate=False,
                                                value_discretization_interval=1e-4).self_compose(s)
            above = direct_poisson_pld(q, sigma, s, DELTA, 1e-4)
            assert below.get_epsilon_for_delta(DELTA) <= schedule.get(s) <= above * 1.01
            rdp = dp_accounting.rdp.RdpAccountant().compose(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), s).get_epsilon(DELTA)
            assert schedule.get(s) <= rdp


def test_a_short_schedule_is_exact_on_every_line():
    from workbench.privacy.accounting.accountant import EXACT_LINES, EpsilonSchedule

    ledger = _CountingAccountant()
    steps = list(range(5, 5 * EXACT_LINES + 1, 5))
    schedule = EpsilonSchedule(ledger, 1e-5, steps)
    assert [schedule.get(s) for s in steps] == [s ** 0.5 for s in steps] and ledger.asked == [steps[-1], *steps[:-1]]
