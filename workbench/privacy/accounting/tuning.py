"""What a sweep costs, every point having trained on the same private data (under the points' neighbouring relation,
Mechanism.adjacency):

- ``sweep_epsilon_all``: publishing every point. The PLD composition of all children's DP events (each child's q,
  sigma, steps, W, shard: :meth:`workbench.privacy.Accountant.pld`), at the smallest delta of the children.
- ``sweep_epsilon_best`` (``sweep.tuning=random_stopping``): publishing only the best of K trials, each a uniformly
  drawn point, K random. Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022:
  Theorem 2 (K truncated negative binomial D_{eta,gamma}) and Theorem 6 (K Poisson with mean mu) bound the *Renyi* DP
  of the tuned algorithm, order by order, from the RDP (and, for Poisson, one (eps_hat, delta_hat)-DP point) of one
  trial; :func:`random_stopping_epsilon` converts that RDP curve to (epsilon, delta)-DP with ``dp_accounting``'s
  conversion (Canonne, Kamath & Steinke 2020, Prop. 12). One trial is a random choice among the points, so its RDP
  is at most the worst point's (Renyi divergence is quasi-convex) and its delta_hat at most the worst point's.
  "The points" are every point of the grid, drawn or not (which are drawn is itself random): the driver builds each
  one's mechanism from its config before anything trains (``candidates`` in the sweep file). The parent reports
  this bound as ``sweep_epsilon_best_rdp``, the privacy-profile bound of selection.py as
  ``sweep_epsilon_best_profile``, and the smaller of the two (both valid) as ``sweep_epsilon_best``.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import numpy as np

from workbench.errors import WorkbenchError
from workbench.privacy.accounting import selection
from workbench.privacy.accounting.accountant import Accountant

TRIALS = ("poisson", "truncated_negative_binomial")
# RDP orders for the random-stopping bound: dp_accounting's RdpAccountant defaults, denser where the optimum lies.
ORDERS = np.concatenate([1 + np.arange(1, 100) / 10, np.arange(11, 64), [128, 256, 512, 1024]]).astype(float)


def composed_epsilon(runs: Sequence[tuple[Accountant, int]], delta: float) -> float:
    """Epsilon at `delta` of publishing every run: the PLD composition of their DP events (one discretization)."""
    pld = None
    for accountant, steps in runs:
        if steps == 0:
            continue
        if accountant.noise_multiplier == 0:
            return math.inf
        one = accountant.pld(steps)
        pld = one if pld is None else pld.compose(one)
    return 0.0 if pld is None else float(pld.get_epsilon_for_delta(delta))


def expected_trials(trials: str, poisson_mean: float = 3.0, eta: float = 0.0, gamma: float = 0.2) -> float:
    """E[K]: mu for Poisson; for the truncated negative binomial D_{eta,gamma} (Papernot & Steinke, Section 3.2)
    eta (1 - gamma) / (gamma (1 - gamma^eta)), and (1/gamma - 1) / log(1/gamma) at eta = 0 (logarithmic)."""
    if trials == "poisson":
        return poisson_mean
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 - gamma) / (gamma * (1 - gamma**eta))


def _tnb_pmf(k: int, eta: float, gamma: float) -> float:
    """P[K = k], k >= 1, of D_{eta,gamma}: (1-gamma)^k / (gamma^-eta - 1) prod_{l<k} (l+eta)/(l+1); at eta = 0
    the logarithmic distribution (1-gamma)^k / (k log(1/gamma))."""
    if eta == 0:
        return (1 - gamma) ** k / (k * math.log(1 / gamma))
    product = math.prod((l + eta) / (l + 1) for l in range(k))
    return (1 - gamma) ** k / (gamma**-eta - 1) * product


def _distinct_mechanisms(runs):
    """The runs that spend privacy, one per mechanism (a learning-rate sweep needs one computation), and the answer
    when there is nothing to compute: inf when one has no noise, 0 when none takes a step (data never read)."""
    runs = [(a, n) for a, n in runs if n > 0]
    if any(a.noise_multiplier == 0 for a, _ in runs):
        return runs, math.inf
    if not runs:
        return runs, 0.0
    # the whole mechanism (bandmf's bands, blt's strategy and k too), so that no distinct one is dropped
    return list({(repr({k: v for k, v in a.state_dict().items() if k != "steps"}), n): (a, n)
                 for a, n in runs}.values()), None


def profile_epsilon(runs: Sequence[tuple[Accountant, int]], delta: float, trials: str,
                    poisson_mean: float = 3.0, eta: float = 0.0, gamma: float = 0.2) -> float:
    """Epsilon at `delta` of publishing only the best of K trials, each one of `runs`, from their privacy profiles
    (:func:`workbench.privacy.accounting.selection.profile_epsilon`). A trial is a uniformly drawn run: its profile is at most the
    worst run's, t by t (the hockey-stick divergence is jointly convex), and that maximum is what is used."""
    runs, trivial = _distinct_mechanisms(runs)
    if trivial is not None:
        return trivial
    plds = [a.pld(n) for a, n in runs]
    phi_prime = selection.pgf_derivative(trials, poisson_mean, eta, gamma)
    return selection.profile_epsilon(lambda t: np.max([p.get_delta_for_epsilon(t) for p in plds], axis=0), delta,
                                     phi_prime)


def random_stopping_epsilon(runs: Sequence[tuple[Accountant, int]], delta: float, trials: str,
                            poisson_mean: float = 3.0, eta: float = 0.0, gamma: float = 0.2,
                            orders: Sequence[float] = ORDERS) -> float:
    """Epsilon at `delta` of publishing only the best of K trials, each trial one of `runs` (a random point).

    Per RDP order lambda, with eps(lambda) the worst trial's RDP:
      truncated negative binomial (Theorem 2), minimised over lambda_hat in {1} + orders:
        eps'(lambda) = eps(lambda) + (1+eta)(1 - 1/lambda_hat) eps(lambda_hat) + (1+eta) log(1/gamma)/lambda_hat
                       + log(E[K]) / (lambda - 1)
      Poisson (Theorem 6), with delta_hat the worst trial's delta at eps_hat = log(1 + 1/(lambda-1)) (from its PLD):
        eps'(lambda) = eps(lambda) + mu delta_hat + log(mu) / (lambda - 1)
    then the RDP-to-(epsilon, delta) conversion of dp_accounting.rdp.compute_epsilon, minimised over lambda.
    """
    orders = np.asarray(orders, dtype=float)
    runs, trivial = _distinct_mechanisms(runs)
    if trivial is not None:
        return trivial
    absl = logging.getLogger("absl")  # dp_accounting drops orders whose series does not converge, one line each
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        rdp = np.max([acc.rdp(steps, orders) for acc, steps in runs], axis=0)
    finally:
        absl.setLevel(level)
    if trials == "truncated_negative_binomial":
        hat = np.concatenate([[(1 + eta) * math.log(1 / gamma)],
                              (1 + eta) * (1 - 1 / orders) * rdp + (1 + eta) * math.log(1 / gamma) / orders])
        log_mean = math.log(expected_trials(trials, eta=eta, gamma=gamma))
        total = rdp + hat.min() + log_mean / (orders - 1)
    elif trials == "poisson":
        eps_hat = np.log1p(1 / (orders - 1))
        order = np.argsort(eps_hat)  # dp_accounting wants ascending epsilons
        delta_hat = np.empty_like(eps_hat)
        delta_hat[order] = np.max([acc.pld(steps).get_delta_for_epsilon(eps_hat[order]) for acc, steps in runs], axis=0)
        total = rdp + poisson_mean * delta_hat + math.log(poisson_mean) / (orders - 1)
    else:
        raise WorkbenchError(f"sweep.trials={trials!r} is unknown; choose one of {', '.join(TRIALS)}")
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    return float(compute_epsilon(list(orders), list(total), delta)[0])
