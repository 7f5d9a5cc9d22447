"""What epsilon means: the most any membership-inference attack can achieve against a run, from the run's own PLD.

A membership test sees the trained model (everything the run released) and says "member" or "non-member" about one
example. Its false-positive rate alpha (saying "member" about a non-member) and its true-positive rate (saying "member"
about a member) are limited by the mechanism's f-DP trade-off function f (Dong, Roth & Su, "Gaussian Differential
Privacy", JRSS-B 2022, arXiv:1905.02383): every test has TPR <= 1 - f(alpha).

**From the privacy profile to f.** The run is (eps, delta(eps))-DP for every eps >= 0 under its neighbouring relation
(Mechanism.adjacency), with delta(eps) = max(delta_remove(eps), delta_add(eps)), the hockey-stick divergences of the two directions of the
PLD (``PrivacyLossDistribution.get_delta_for_epsilon`` takes the same max). A whole profile is equivalent to f-DP with
(DRS19, Proposition 2.12; each (eps, delta)-DP statement is f_{eps,delta}-DP, Proposition 2.5)

    f(alpha) = sup_{eps >= 0} max(0, 1 - delta(eps) - e^eps alpha, e^-eps (1 - delta(eps) - alpha)),

symmetric in the two directions, so it bounds a test of either kind ("member" or "non-member" as the positive).
The bounds given here:

- ``tpr(alpha)`` = 1 - f(alpha): the most TPR at FPR alpha;
- ``advantage`` = max_alpha (TPR - alpha) = delta(0), the total-variation distance between the outputs with and
  without the example: the most any attack gains over guessing (the membership advantage of Yeom et al. 2018).

**Why every number is an upper bound on the attacker.**

1. delta(eps) is dp_accounting's *pessimistic* PLD (losses rounded up, "connect the dots", truncated tails moved to
   infinite loss): at every eps it is at least the true delta (the same guarantee every epsilon the workbench reports
   rests on). A larger delta can only lower each term of the sup, so f is lowered and 1 - f raised.
2. The sup over eps is taken *exactly* for that discretised profile, not over a sampled grid: the discretised PLD has
   all its losses on the grid k d (d its discretisation interval), and between two neighbouring grid points delta is
   A - e^eps B with A, B constant (the masses above the interval, under the pair's two distributions), so both terms
   of the sup are monotone in eps there (1 - A + e^eps (B - alpha) and e^-eps (1 - A - alpha) + B): the sup over eps in
   [0, inf) is attained at a grid point k d >= 0 or at the largest finite loss (past it delta is the constant
   infinite-loss mass and both terms fall). Evaluating at every grid point from 0 to the largest finite loss is the
   sup. (Were a subset of eps used, the sup would only fall, f fall and 1 - f rise: still an upper bound, looser.)
3. delta on the grid is computed from the pmf with suffix sums in float64 (``_deltas``; checked against
   dp_accounting's own ``get_delta_for_epsilon`` in the tests); its rounding (~1e-16 of the tail mass) is far below the
   discretisation's own pessimism. The sums of e^(eps - l) are taken in log space and e^eps alpha as
   e^(eps + log alpha), so that no term over- or underflows into inf * 0 = NaN at any loss, however small sigma is
   (a run at sigma 0.05 has losses past 700, where e^eps is inf in float64): every bound is finite, in [alpha, 1].

**Its limit.** As sigma -> 0 each step's Gaussian becomes perfectly telling whenever the example is drawn, and the PLD
tends to "the output is the same (probability 1 - c) or reveals the example (c)", c the probability that the example
is drawn at least once (1 - (1 - q)^T for Poisson; bandmf: ceil(T / b) draws at p; blt, unsampled: c = 1). Its profile
is delta(eps) = max(c, 1 - e^eps (1 - c)), so f(alpha) = max(0, 1 - c - alpha) and the bound tends to
min(1, alpha + c) (the advantage to c): 1 whenever the run makes it near-certain that every example was drawn
(tests/test_tradeoff.py checks this limit, and the float64 sup against the same sup in 50-digit arithmetic).

The PLD used is :meth:`Accountant.pld`: the PLD of exactly the run's DP event (q, sigma, steps, world size and shard
mode) at the accountant's discretisation, whatever the accountant that reports epsilon (``pld``, ``rdp`` or ``prv``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from workbench.errors import WorkbenchError

# The FPRs the run's MLflow metrics report (mia_tpr_at_fpr_<alpha>) and the grid the drawn curve uses.
REPORTED_FPRS = (1e-3, 1e-2)
CURVE_FPRS = tuple(sorted({*np.logspace(-6, 0, 121).tolist(), *np.linspace(0, 1, 101)[1:].tolist(), *REPORTED_FPRS}))


@dataclass(frozen=True)
class TradeOff:
    """The bounds of one PLD: ``fpr`` and ``tpr`` (the curve: the most TPR at each FPR) and ``advantage``."""

    fpr: tuple[float, ...]
    tpr: tuple[float, ...]
    advantage: float

    def metrics(self) -> dict[str, float]:
        """The MLflow metrics: ``mia_tpr_at_fpr_0.001``, ``mia_tpr_at_fpr_0.01``, ``mia_advantage``."""
        at = dict(zip(self.fpr, self.tpr))
        return {**{f"mia_tpr_at_fpr_{a:g}": at[a] for a in REPORTED_FPRS}, "mia_advantage": self.advantage}


def _dense(pmf):
    """(losses on the grid, their probabilities, the infinite-loss mass) of one direction's pmf."""
    dense = pmf.to_dense_pmf()
    # pylint: disable=protected-access
    losses = (np.arange(dense.size) + dense._lower_loss) * dense._discretization
    return losses, np.asarray(dense._probs, dtype=np.float64), float(dense._infinity_mass), dense._discretization


def _deltas(pmf, top: int) -> np.ndarray:
    """delta(k d) for k = 0..top of one direction: inf_mass + sum_{l_i > eps} p_i (1 - e^(eps - l_i))."""
    losses, probs, inf_mass, d = _dense(pmf)
    eps = np.arange(top + 1) * d
    keep = losses > 0  # only losses above eps >= 0 count
    losses, probs = losses[keep], probs[keep]
    # suffix sums over losses > eps: P(L > eps), and log E[e^-L; L > eps] in log space: e^eps and e^-L alone over-
    # and underflow past 709 (tiny sigma), and inf * 0 would be NaN; eps + log E[e^-L; L > eps] <= log P(L > eps) <= 0
    # (the FFT's composition leaves some probabilities a hair below 0: their part is summed apart, not dropped)
    upper = np.concatenate([np.cumsum(probs[::-1])[::-1], [0.0]])
    first = np.searchsorted(losses, eps, side="right")  # index of the first loss strictly above eps
    lower = np.zeros(len(eps))
    for sign in (1.0, -1.0):
        with np.errstate(divide="ignore"):
            log_terms = np.log(np.maximum(sign * probs, 0.0)) - losses
        log_sums = np.concatenate([np.logaddexp.accumulate(log_terms[::-1])[::-1], [-np.inf]])
        lower += sign * np.exp(eps + log_sums[first])
    delta = inf_mass + upper[first] - lower
    return np.clip(delta, 0.0, 1.0)


def _grid_top(pmf) -> int:
    """The grid index of the largest finite loss (0 when none is positive)."""
    losses, probs, _, d = _dense(pmf)
    positive = np.nonzero((probs > 0) & (losses > 0))[0]
    return int(round(losses[positive[-1]] / d)) if len(positive) else 0


def tradeoff(pld, fpr=CURVE_FPRS) -> TradeOff:
    """The trade-off bounds of ``pld`` (a dp_accounting ``PrivacyLossDistribution``) at each FPR in ``fpr``.
    See the module docstring for the formula and why each step rounds towards the attacker."""
    alphas = np.asarray(fpr, dtype=np.float64)
    if alphas.ndim != 1 or not len(alphas) or not np.all((alphas >= 0) & (alphas <= 1)):
        raise WorkbenchError(f"fpr must be a non-empty list of rates in [0, 1], got {fpr!r}")
    # pylint: disable=protected-access
    pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
    d = {p._discretization for p in pmfs}
    if len(d) != 1:
        raise WorkbenchError("the two directions of the PLD have different discretisations")
    top = max(_grid_top(p) for p in pmfs)
    delta = np.max([_deltas(p, top) for p in pmfs], axis=0)  # the profile: the worse direction at each eps
    eps = np.arange(top + 1) * d.pop()
    tpr = np.empty_like(alphas)
    chunk = max(1, 4_000_000 // len(eps))
    for i in range(0, len(alphas), chunk):
        a = alphas[i:i + chunk, None]
        with np.errstate(over="ignore", divide="ignore"):  # e^eps alpha as exp(eps + log alpha): inf, never inf * 0
            f = np.maximum(1 - delta - np.exp(eps + np.log(a)), np.exp(-eps) * (1 - delta - a)).max(axis=1)
        tpr[i:i + chunk] = 1 - np.maximum(f, 0.0)
    tpr = np.clip(np.maximum(tpr, alphas), 0.0, 1.0)  # guessing at rate alpha always achieves TPR alpha
    return TradeOff(fpr=tuple(float(a) for a in alphas), tpr=tuple(float(t) for t in tpr), advantage=float(delta[0]))


def gaussian_tpr(alpha: float, mu: float) -> float:
    """The exact most TPR at FPR ``alpha`` against mu-GDP (the Gaussian mechanism of sensitivity 1 and noise 1/mu):
    1 - Phi(Phi^-1(1 - alpha) - mu) (DRS19, Definition 2.7). The closed form the tests compare against."""
    from scipy.stats import norm

    return float(norm.sf(norm.isf(alpha) - mu)) if 0 < alpha < 1 else float(alpha)


def membership_bounds(accountant, steps: int) -> TradeOff:
    """The trade-off bounds of ``steps`` steps of ``accountant``'s mechanism (kept in workbench's on-disk cache, as
    its epsilons are, so a rerun reads them back)."""
    from workbench import cache
    from workbench.privacy.accounting.accountant import MODULES

    if accountant.noise_multiplier == 0 or not math.isfinite(accountant.noise_multiplier):
        raise WorkbenchError("no membership bounds without noise (a non-private run)")
    mechanism = {k: v for k, v in accountant.state_dict().items() if k != "steps"}
    code = cache.code_version(tuple(f"privacy/accounting/{name}.py" for name in (*MODULES, "tradeoff")),
                              ("dp-accounting",))

    def compute() -> dict:
        if steps == 0:  # nothing released: guessing is all there is
            return {"fpr": list(CURVE_FPRS), "tpr": list(CURVE_FPRS), "advantage": 0.0}
        t = tradeoff(accountant.pld(int(steps)))
        return {"fpr": list(t.fpr), "tpr": list(t.tpr), "advantage": t.advantage}

    value = cache.cached("tradeoff", compute, **mechanism, steps=int(steps), code=code)
    return TradeOff(fpr=tuple(value["fpr"]), tpr=tuple(value["tpr"]), advantage=float(value["advantage"]))
