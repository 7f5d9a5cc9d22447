"""The privacy profile of private selection: publishing only the best of K runs of a mechanism Q, K random.

Koskela, Redberg & Wang ("Privacy Profiles for Private Selection", ICML 2024) bound the tuned algorithm's privacy
profile delta_A(eps) from the base runs' profile delta_Q (our PLDs) through K's probability generating function
phi(z) = E[z^K], instead of going through Renyi DP (Papernot & Steinke 2022, tuning.py). We could not read
their theorems' exact statements here, so this module implements only the bound proved below, in their spirit
(profiles and phi), and every step of the computation rounds towards a larger delta.

Claim. Let Q be (t, delta_Q(t))-DP for every t >= 0 (both directions of the neighbour relation), and let A run Q
K ~ phi times on the same data and output the best result under a total order (nothing when K = 0). For all
eps1, eps2 >= 0:

    delta_A(eps1 + eps2) <= E[K] delta_Q(eps1) + e^eps1 * integral_0^1 [phi'(h(u)) - e^eps2 phi'(u)]_+ du,
    h(u) = min(1, inf_t e^t u + delta_Q(t)).

Proof. Append an independent Uniform[0,1] tie-break to Q's output (same profile; dropping it again is
post-processing) so that Q's CDF F(y) = P[Q(X) <= y] is continuous and F(Q(X)) is uniform. The best of K draws
then has density phi'(F(y)) with respect to Q(X) (plus an atom phi(0) on "nothing", which adds nothing to the
hockey-stick divergence for eps >= 0). With q, q' the laws of Q(X), Q(X') and F, F' their CDFs, for any event S:
    A(X)(S) - e^(eps1+eps2) A(X')(S) = int_S phi'(F) d(q - e^eps1 q') + e^eps1 int_S (phi'(F) - e^eps2 phi'(F')) dq'.
The first term is at most phi'(1) H_{e^eps1}(q, q') <= E[K] delta_Q(eps1), since phi' is increasing. In the second,
{Q <= y} is an event, so F(y) <= e^t F'(y) + delta_Q(t) for every t: F <= h(F') and phi'(F) <= phi'(h(F')); as F'(Q(X'))
is uniform, the second term is at most e^eps1 int_0^1 [phi'(h(u)) - e^eps2 phi'(u)]_+ du.  QED

Numerically: h is a minimum over a finite grid of t (any subset of t keeps it an upper bound); the integral is an
upper Riemann sum (h and phi' are non-decreasing, so a cell's integrand is at most phi'(h(right end)) - e^eps2 phi'(left
end)); eps1 and eps2 are searched on grids and only a pair whose bound is <= delta is returned. delta_Q comes from a
pessimistic PLD. The result is an upper bound on the true epsilon, not an estimate of it.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

# t (and eps1) grid for h and the first term; eps2 grid for the second. Finer grids are tighter and slower.
T_GRID = np.concatenate([np.linspace(0.0, 4.0, 801), np.linspace(4.0, 40.0, 721)[1:]])
EPS2_GRID = np.concatenate([np.linspace(0.0, 6.0, 1201), np.linspace(6.0, 60.0, 541)[1:]])
# u grid for the integral: uniform, and denser towards 0 where h rises steeply (h(u)/u grows without bound).
U_GRID = np.unique(np.concatenate([[0.0], np.geomspace(1e-12, 1e-3, 1500), np.linspace(0.0, 1.0, 20001)]))


def pgf_derivative(trials: str, poisson_mean: float = 3.0, eta: float = 0.0,
                   gamma: float = 0.2) -> Callable[[np.ndarray], np.ndarray]:
    """phi'(u) = E[K u^(K-1)] for K of `trials` (Papernot & Steinke's distributions; phi'(1) = E[K]):
    Poisson(mu): mu e^(mu (u - 1)); truncated negative binomial D_{eta,gamma}, with phi(z) =
    ((1 - (1-gamma) z)^-eta - 1) / (gamma^-eta - 1): eta (1-gamma) (1 - (1-gamma) u)^(-eta-1) / (gamma^-eta - 1),
    and its limit (1-gamma) / ((1 - (1-gamma) u) log(1/gamma)) at eta = 0 (logarithmic)."""
    if trials == "poisson":
        return lambda u: poisson_mean * np.exp(poisson_mean * (np.asarray(u, dtype=float) - 1))
    if trials == "truncated_negative_binomial":
        if eta == 0:
            return lambda u: (1 - gamma) / ((1 - (1 - gamma) * np.asarray(u, dtype=float)) * math.log(1 / gamma))
        scale = eta * (1 - gamma) / (gamma**-eta - 1)
        return lambda u: scale * (1 - (1 - gamma) * np.asarray(u, dtype=float)) ** (-eta - 1)
    raise ValueError(f"no generating function for trials={trials!r}")


def profile_epsilon(delta_q: Callable[[np.ndarray], np.ndarray], delta: float,
                    phi_prime: Callable[[np.ndarray], np.ndarray]) -> float:
    """Epsilon at `delta` of publishing the best of K runs of Q (the claim above). `delta_q(t)`: Q's privacy profile
    at an ascending array of t >= 0 (an upper bound on it is fine); `phi_prime`: K's phi' (:func:`pgf_derivative`).
    Returns inf when no pair on the grids meets `delta`."""
    dq = np.minimum(np.asarray(delta_q(T_GRID), dtype=float), 1.0)
    if not np.all(np.isfinite(dq)):
        return math.inf
    mean = float(phi_prime(np.array([1.0]))[0])
    # h(u) = min(1, min_t e^t u + delta_Q(t)), in chunks of u to bound memory
    h = np.empty_like(U_GRID)
    for i in range(0, len(U_GRID), 4096):
        u = U_GRID[i:i + 4096, None]
        h[i:i + 4096] = np.minimum(1.0, (np.exp(T_GRID)[None, :] * u + dq[None, :]).min(axis=1))
    upper = phi_prime(h[1:])  # phi'(h) at each cell's right end
    lower = phi_prime(U_GRID[:-1])  # phi'(u) at each cell's left end
    width = np.diff(U_GRID)
    second = np.array([np.sum(width * np.maximum(upper - math.exp(e2) * lower, 0.0)) for e2 in EPS2_GRID])
    second = np.minimum.accumulate(second)  # non-increasing in eps2: a larger eps2 may use a smaller one's value
    best = math.inf
    for e1, d1 in zip(T_GRID, dq):
        room = delta - mean * d1
        if room <= 0:
            continue
        meets = np.nonzero(math.exp(e1) * second <= room)[0]
        if len(meets):
            best = min(best, float(e1 + EPS2_GRID[meets[0]]))
    return best
