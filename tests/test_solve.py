"""The accounting's one root solver (workbench/privacy/accounting/solve.py): the end it returns meets the target and
lies next to a point that misses; checked against brute force over integers and a closed-form root over the reals."""

import math
import random

import pytest

from workbench.privacy.accounting.solve import meeting_end


class Recorded:
    """A function of x that remembers every point it was asked for."""

    def __init__(self, f):
        self.f, self.calls = f, {}

    def __call__(self, x):
        self.calls[x] = self.f(x)
        return self.calls[x]


def _largest_meeting(f, target, lo, hi):  # brute force: the integer answer of a monotone increasing f
    return max(t for t in range(lo, hi + 1) if f(t) <= target)


def _increasing(rng: random.Random, hi: int) -> list[float]:
    """A random non-decreasing curve over 0..hi, with flat stretches (repeated values) and jumps."""
    values, v = [], rng.uniform(0.01, 1.0)
    for _ in range(hi + 1):
        values.append(v)
        v += rng.choice([0.0, 0.0, rng.uniform(0, 0.05), rng.uniform(0, 2.0)])
    return values


def test_integers_give_the_most_steps_that_meet_as_brute_force_does():
    rng = random.Random(0)
    for _ in range(300):
        hi = rng.randint(2, 400)
        curve = _increasing(rng, hi)
        lo = 1
        # targets between the ends, at a value the curve takes (its flat stretches included), or just below one
        pick = curve[rng.randint(lo, hi - 1)]
        target = rng.choice([pick, math.nextafter(pick, -math.inf), rng.uniform(curve[lo], curve[hi])])
        if not curve[lo] <= target < curve[hi]:
            continue
        f = Recorded(lambda t: curve[t])
        got = meeting_end(f, target, lo, hi)
        assert got == _largest_meeting(lambda t: curve[t], target, lo, hi)
        assert type(got) is int and all(type(t) is int for t in f.calls)  # only integers asked for
        assert len(f.calls) <= hi - lo + 1


def test_reals_give_a_sigma_that_meets_within_rtol_of_the_exact_root():
    rng = random.Random(1)
    for _ in range(200):
        k, p = rng.uniform(0.1, 50.0), rng.uniform(0.3, 3.0)
        target = rng.uniform(0.05, 20.0)
        root = (k / target) ** (1 / p)  # epsilon = k / sigma^p, decreasing: sigma meets from root up
        lo, hi = root / rng.uniform(1.01, 100.0), root * rng.uniform(1.01, 100.0)
        rtol = rng.choice([2e-3, 1e-2, 1e-5])
        f = Recorded(lambda s: k / s ** p)
        got = meeting_end(f, target, lo, hi, rtol=rtol)
        assert f(got) <= target  # the safe side, exactly
        assert got <= root * (1 + rtol) * (1 + 1e-12)
        missed = [x for x, e in f.calls.items() if not e <= target]
        assert max(missed) * (1 + rtol) >= got  # a point that misses lies within a factor 1 + rtol below


def test_an_increasing_real_curve_returns_its_lower_end_side():
    target = 3.0
    got = meeting_end(lambda x: x, target, 0.5, 40.0, rtol=1e-6)  # epsilon = x: meets up to 3
    assert got <= target and got >= target / (1 + 1e-6)


def test_a_target_at_a_bracket_end_meets_there():
    # epsilon equal to the target at the meeting end: that end meets (<=), nothing above it does
    assert meeting_end(lambda t: 1.0 if t <= 1 else 2.0, 1.0, 1, 100) == 1
    assert meeting_end(lambda s: 2.0 if s < 10.0 else 1.0, 1.0, 0.5, 10.0, rtol=1e-3) == 10.0
    # the missing end just above the target: everything below meets
    assert meeting_end(lambda t: 1.0 if t < 100 else math.nextafter(1.0, 2.0), 1.0, 1, 100) == 99


def test_a_flat_stretch_below_the_target_is_crossed_to_its_far_end():
    curve = lambda t: 0.5 if t <= 900 else 10.0  # noqa: E731  (flat far below the target, then a jump)
    assert meeting_end(curve, 1.0, 1, 1000) == 900
    flat_at_target = lambda t: t / 100 if t < 100 else (1.0 if t <= 700 else t / 700)  # noqa: E731
    assert meeting_end(flat_at_target, 1.0, 1, 1000) == 700


def test_the_side_is_the_exact_comparison_not_the_log_gap():
    """A point above the target by one float whose log rounds to the target's misses: the log only guesses."""
    target = 1e6
    above = math.nextafter(target, math.inf)
    assert math.log(above) == math.log(target)  # the log gap cannot tell them apart
    assert meeting_end(lambda t: target if t <= 37 else above, target, 1, 200) == 37
    got = meeting_end(lambda s: above if s < 5.0 else target, target, 1.0, 50.0, rtol=1e-3)
    assert 5.0 <= got <= 5.0 * (1 + 1e-3)


def test_a_curve_that_is_not_monotone_still_gives_a_meeting_point_next_to_a_missing_one():
    rng = random.Random(2)
    for _ in range(200):
        hi = rng.randint(2, 300)
        values = [rng.uniform(0, 2) for _ in range(hi + 1)]
        values[1], values[hi] = 0.5, 1.5
        f = Recorded(lambda t: values[t])
        got = meeting_end(f, 1.0, 1, hi)
        assert values[got] <= 1.0 and values[got + 1] > 1.0 and got + 1 in f.calls


def test_nan_misses():
    assert meeting_end(lambda t: 0.1 * t if t <= 20 else math.nan, 100.0, 1, 50) == 20
    with pytest.raises(ValueError, match="straddle"):
        meeting_end(lambda t: math.nan, 1.0, 1, 50)


@pytest.mark.parametrize("f, lo, hi, rtol", [
    (lambda t: 0.5, 1, 10, None),  # both ends meet
    (lambda t: 5.0, 1, 10, None),  # both miss
    (lambda s: 1.0 / s, 2.0, 4.0, 1e-3),  # both meet (epsilon 0.5, 0.25 <= 1)
])
def test_a_bracket_that_does_not_straddle_the_target_is_refused(f, lo, hi, rtol):
    with pytest.raises(ValueError, match="straddle"):
        meeting_end(f, 1.0, lo, hi, rtol=rtol)


@pytest.mark.parametrize("lo, hi, rtol", [(5, 5, None), (6, 5, None), (0, 5, None), (1.5, 5, None), (0.0, 1.0, 1e-3),
                                          (2.0, 1.0, 1e-3)])
def test_a_malformed_bracket_is_refused(lo, hi, rtol):
    with pytest.raises(ValueError, match="not a bracket"):
        meeting_end(lambda x: x, 1.0, lo, hi, rtol=rtol)


def test_a_target_below_the_log_floor_still_gives_the_exact_answer():
    """Below 1e-300 the log gap is floored: both ends' gaps can share a sign and the secant extrapolates far out of
    the bracket (exp would overflow). The side is still the exact comparison's, the answer brute force's."""
    target = 1e-305
    assert meeting_end(lambda t: 1e-310 if t <= 600 else 1e-303, target, 1, 10 ** 6) == 600
    # decreasing: the missing end's gap just above the meeting end's floored one puts the secant at about 1e7 x b
    assert meeting_end(lambda t: 1.000001e-300 if t < 600 else 1e-310, target, 1, 10 ** 6) == 600
    got = meeting_end(lambda s: 1.000001e-300 if s < 7.0 else 1e-310, target, 1.0, 1000.0, rtol=1e-3)
    assert 7.0 <= got <= 7.0 * (1 + 1e-3)
