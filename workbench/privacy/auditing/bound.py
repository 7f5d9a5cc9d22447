"""The one-run privacy audit: a statistically valid lower bound on a run's epsilon from its own canaries.

Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training Run" (arXiv:2305.08846). m canaries are each
included in the training set with probability 1/2 (secret, independent draws); after training an observer scores them,
guesses "member" for the top ``k+`` scores and "non-member" for the bottom ``k-`` (abstaining on the rest), and counts
its correct guesses v out of r = k+ + k-. The paper's main theorem (Theorem 3.1, (epsilon, delta)-DP with its delta
term) bounds how many correct guesses an (epsilon, delta)-DP run allows: with q = e^eps / (1 + e^eps),

    P[V >= v] <= beta + 2 m delta alpha,    beta  = P[Binomial(r, q) >= v],
                                            alpha = max_{1 <= i <= v}  P[v - i <= Binomial(r, q) < v] / i

(the computable form of the authors' own code, also jax_privacy's ``auditing._one_run_p_value``). :func:`p_value`
is that right-hand side; :func:`epsilon_lower_bound` is the largest epsilon it rejects at a given significance.

The guesses are not tuned after looking at the scores: :data:`GUESS_GRID` is fixed in advance and every (observer,
grid point) is one test; a Bonferroni correction (significance / number of tests) keeps the family-wise error at the
significance, so the reported bound (the largest over all tests) holds with probability >= 1 - significance.

:func:`white_box_llr` scores what DP-SGD releases (every noised update) by the exact likelihood ratio of the
canary's per-step multiplicity (Bernoulli(q) per rank, Binomial(W, q_r) for ``shard=global``);
:func:`ideal_lower_bound` runs the same audit on a simulation of a correct DP-SGD with the run's q, sigma and steps,
so a weak audit can be told from a broken trainer. The canaries themselves live in canaries.py, next to this file.

Pure math, below the job runner: ``workbench.audit`` re-exports it under its public path, and ``python -m
workbench.audit [overrides]`` (workbench/audit/__main__.py, above the job runner) trains with ``audit=canaries`` and prints the bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
from scipy import stats
from scipy.special import logsumexp

from workbench.privacy.accounting import events

# (k+, k-) as fractions of the canaries: top-k+ guessed members, bottom-k- guessed non-members. Fixed in advance.
GUESS_GRID: tuple[tuple[float, float], ...] = (
    (0.02, 0.0), (0.05, 0.0), (0.1, 0.0), (0.2, 0.0), (0.3, 0.0), (0.4, 0.0), (0.5, 0.0), (0.25, 0.25),
)
SIGNIFICANCE = 0.05
IDEAL_SEED = 0  # the simulation's own seed: the same run config always gets the same ideal bound


# ------------------------------------------------------------------------------------------------- the bound


def p_value(m: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The probability, under any (epsilon, delta)-DP run, of ``correct`` or more correct guesses out of ``guesses``
    on ``m`` canaries (each a member with probability 1/2): the theorem's right-hand side, capped at 1."""
    if not 0 <= correct <= guesses <= m:
        raise ValueError(f"need 0 <= correct <= guesses <= m, got {correct}, {guesses}, {m}")
    if correct == 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-epsilon))  # the accuracy of epsilon-DP randomized response
    beta = float(stats.binom.sf(correct - 1, guesses, q))
    if delta == 0:
        return min(beta, 1.0)
    i = np.arange(1, correct + 1)
    below = stats.binom.sf(correct - i - 1, guesses, q) - beta  # P[v - i <= Binomial(r, q) < v]
    alpha = float(np.max(below / i))
    return min(beta + 2 * m * delta * alpha, 1.0)


def epsilon_lower_bound(m: int, guesses: int, correct: int, delta: float, significance: float) -> float:
    """The largest epsilon whose (epsilon, delta)-DP claim these counts reject at ``significance`` (0: none)."""
    if p_value(m, guesses, correct, 0.0, delta) > significance:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, guesses, correct, hi, delta) <= significance:
        lo, hi = hi, 2 * hi
        if hi > 1e3:  # a p-value that never rises (correct == 0 cannot reach here): no finite bound
            return lo
    for _ in range(60):  # bisection to ~1e-12 relative: p_value is monotone in epsilon
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p_value(m, guesses, correct, mid, delta) <= significance else (lo, mid)
    return lo


def guess_counts(m: int) -> list[tuple[int, int]]:
    """The grid in canaries: (k+, k-) per point, at least one guess each, duplicates dropped (small m)."""
    out: list[tuple[int, int]] = []
    for plus, minus in GUESS_GRID:
        point = (round(plus * m), round(minus * m))
        if sum(point) > 0 and point not in out:
            out.append(point)
    return out


def correct_guesses(scores: np.ndarray, members: np.ndarray, k_plus: int, k_minus: int) -> int:
    """Guess member for the k+ highest scores and non-member for the k- lowest; count the correct guesses.
    Ties are broken by canary index, which membership is independent of."""
    order = np.argsort(-np.asarray(scores, dtype=float), kind="stable")
    members = np.asarray(members, dtype=bool)
    top, bottom = order[:k_plus], order[len(order) - k_minus:] if k_minus else order[:0]
    return int(members[top].sum() + (~members[bottom]).sum())


@dataclass(frozen=True)
class AuditResult:
    """One audit: the bound, the test it came from, and how the reported epsilon fares against all tests."""

    epsilon_lower_bound: float
    correct: int  # v of the test that gave the bound
    guesses: int  # r of that test
    observer: str  # which observer's scores gave it
    canaries: int
    tests: int  # the Bonferroni family size
    significance: float
    delta: float
    p_value_of_reported: float | None  # Bonferroni-adjusted; None when no epsilon is reported (privacy=none)
    ideal_lower_bound: float | None = None
    unit: str = "example"  # the unit of privacy the canaries are (privacy.unit=user: canary users; the bound is per user)

    def metrics(self) -> dict[str, float]:
        """What MLflow gets (beside epsilon and delta)."""
        out = {"audit_epsilon_lower_bound": self.epsilon_lower_bound, "audit_correct": self.correct,
               "audit_guesses": self.guesses, "audit_canaries": self.canaries, "audit_tests": self.tests,
               "audit_significance": self.significance}
        if self.p_value_of_reported is not None:
            out["audit_p_value_of_reported"] = self.p_value_of_reported
        if self.ideal_lower_bound is not None:
            out["audit_ideal_lower_bound"] = self.ideal_lower_bound
        return out


def audit(scores: Mapping[str, np.ndarray], members: np.ndarray, delta: float, significance: float = SIGNIFICANCE,
          reported_epsilon: float | None = None) -> AuditResult:
    """The bound from every observer's scores (higher = more likely a member) on the fixed grid, Bonferroni-corrected."""
    members = np.asarray(members, dtype=bool)
    m = len(members)
    tests = [(name, k_plus, k_minus, correct_guesses(s, members, k_plus, k_minus))
             for name, s in scores.items() for k_plus, k_minus in guess_counts(m)]
    level = significance / len(tests)
    bounds = [epsilon_lower_bound(m, kp + km, v, delta, level) for _, kp, km, v in tests]
    best = int(np.argmax(bounds))
    name, k_plus, k_minus, correct = tests[best]
    p_reported = None
    if reported_epsilon is not None and math.isfinite(reported_epsilon):
        p_reported = min(1.0, len(tests) * min(p_value(m, kp + km, v, reported_epsilon, delta)
                                               for _, kp, km, v in tests))
    return AuditResult(bounds[best], correct, k_plus + k_minus, name, m, len(tests), significance, delta, p_reported)


# ------------------------------------------------------------------------------------ the white-box observer


def multiplicity_probs(sample_rate: float, world_size: int, shard: str) -> np.ndarray:
    """P(K = k) for a canary's multiplicity K in one step: the accounted event's (privacy/accounting/events.py)."""
    return np.asarray(events.multiplicity_probs(sample_rate, world_size, shard))


def white_box_llr(x: np.ndarray, sigma: float, probs: np.ndarray) -> np.ndarray:
    """Per canary, log P(x | member) / P(x | non-member) for one step's observation x = K + sigma Z (the canary's
    coordinate of the released update in units of C / B): log sum_k p_k exp((k x - k^2 / 2) / sigma^2).
    sigma = 0 (no noise): x itself (x = K exactly; any positive value proves membership)."""
    return block_llr(x, 1.0, sigma, probs)


def block_llr(a: np.ndarray, n: np.ndarray | float, sigma: float, probs: np.ndarray) -> np.ndarray:
    """The same ratio for a block v = K c + sigma Z (Z iid N(0, I)) of known direction c, seen through its sufficient
    statistic a = <v, c> with n = ||c||^2: log sum_k p_k exp((k a - k^2 n / 2) / sigma^2). BandMF's whitened
    observations are such blocks (canaries.py); DP-SGD's one step is the block c = (1,). sigma = 0: a / n."""
    a = np.asarray(a, dtype=float)
    n = np.broadcast_to(np.asarray(n, dtype=float), a.shape)
    if sigma == 0:
        return a / n
    k = np.arange(len(probs), dtype=float)
    with np.errstate(divide="ignore"):
        log_p = np.log(probs)
    return logsumexp(log_p[None, :] + (np.outer(a, k) - np.outer(n, k**2) / 2) / sigma**2, axis=1)


def ideal_lower_bound(m: int, sample_rate: float, sigma: float, steps: int, world_size: int, shard: str, delta: float,
                      significance: float = SIGNIFICANCE, observers: int = 2, seed: int = IDEAL_SEED,
                      coefficients: tuple[float, ...] | None = None, bands: np.ndarray | None = None) -> float:
    """The bound a correct DP-SGD would reach: the white-box audit of a simulated run (same m, q, sigma, steps,
    multiplicities), with the real audit's Bonferroni family (``observers`` x the grid) so the two compare.
    BandMF (``coefficients`` c, each canary's cyclic part in ``bands``): the whitened blocks the white-box observer
    scores, block s of norm^2 n_s = sum_{d < min(b, T - s)} c_d^2 (canaries.py's WhiteBoxObserver)."""
    rng = np.random.default_rng(seed)
    members = rng.random(m) < 0.5
    probs = multiplicity_probs(sample_rate, world_size, shard)
    scores = np.zeros(m)
    if coefficients is not None:
        b, tail = len(coefficients), np.cumsum(np.square(coefficients))
        for first in range(0, steps, b):  # the i-th participation step of each canary: s = first + its band
            s = first + np.asarray(bands)
            live = s < steps
            n = tail[np.clip(steps - s, 1, b) - 1]
            k = rng.choice(len(probs), size=m, p=probs) * members
            a = k * n + sigma * np.sqrt(n) * rng.standard_normal(m)
            scores += np.where(live, block_llr(a, n, sigma, probs), 0.0)
    else:
        for start in range(0, steps, 256):  # chunks of steps: memory m x 256
            n = min(256, steps - start)
            k = rng.choice(len(probs), size=(n, m), p=probs) * members
            x = k + sigma * rng.standard_normal((n, m))
            scores += white_box_llr(x.ravel(), sigma, probs).reshape(n, m).sum(axis=0)
    tests = len(guess_counts(m)) * observers
    level = significance / tests
    return max(epsilon_lower_bound(m, kp + km, correct_guesses(scores, members, kp, km), delta, level)
               for kp, km in guess_counts(m))
