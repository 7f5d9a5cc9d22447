"""Correlated noise by a Buffered Linear Toeplitz strategy, BLT (issue 22; Dvijotham et al. 2024, "Efficient and
near-optimal noise generation for streaming differential privacy"; McMahan et al. 2024; jax_privacy 2.0.0's
``matrix_factorization/buffered_toeplitz.py`` is the reference this mirrors in numpy, checked in tests/test_blt.py).

The strategy. C is lower-triangular Toeplitz with c_0 = 1 and c_j = sum_i s_i theta_i^(j-1) for j >= 1 (d buffers:
``buf_decay`` theta, ``output_scale`` s). Step t's noise (C^{-1} z)_t solves C x = z forward: x_t = z_t -
sum_i s_i u_i, then u_i <- theta_i u_i + x_t: d buffers of the model's size (correlated.py's BLTNoise), O(d x
model) memory, whatever the number of steps. C^{-1} is again a BLT (:meth:`BLT.inverse`): the error computation
uses its coefficients.

The strategy used (:func:`strategy`) is the rational approximation of (1 - x)^(-1/2) of d buffers (jax_privacy's
``from_rational_approx_to_sqrt_x`` with ``get_init_blt``'s limits, Proposition 4.5 of arXiv:2404.16706), then, when
it improves, Nelder-Mead on its 2d parameters for the prefix-sum error (the mean over steps of ||row t of A C^{-1}||^2,
A the prefix-sum workload) times the min-separation sensitivity squared: ``LossFn.build_min_sep(error='mean')``'s
loss. It depends on T, k and d only: public, cached and checkpointed.

The sensitivity (:func:`sensitivity`). Participation is fixed batches (cyclic.py's FixedBatchSampler): an example
takes part at steps s, s + k, s + 2k, ... for its part s. With Toeplitz coefficients that are non-negative, C's
columns have non-negative inner products, so the worst case of an example's clipped contributions is all of them
aligned, and its L2 sensitivity in units of C_clip after t steps is ||sum over its steps j < t of C[:t, j]||. Part s's
vector is part 0's shifted down by s, so part 0 (steps 0, k, 2k, ...) is the maximum; v_i = v_{i-k} + c_i gives it for
every t in one O(T) pass. This is jax_privacy's ``minsep_sensitivity_squared`` for min_sep = k (equal to it: the
worst min-sep pattern is this one for non-increasing coefficients). A strategy whose coefficients are negative or
increasing anywhere in the run is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from workbench.errors import WorkbenchError

SENSITIVITY_MARGIN = 1e-9  # relative: the float64 sums of T positive terms err by ~T 2^-53; reported above, never below


@dataclass(frozen=True)
class BLT:
    """A lower-triangular Toeplitz matrix with c_0 = 1 and c_j = sum_i output_scale_i buf_decay_i^(j-1), j >= 1."""

    buf_decay: tuple[float, ...]
    output_scale: tuple[float, ...]

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        """c_0..c_{n-1} (jax_privacy's ``toeplitz_coefs``)."""
        theta, s = np.asarray(self.buf_decay, float), np.asarray(self.output_scale, float)
        powers = np.arange(max(n - 1, 0))[:, None]
        return np.concatenate([[1.0], (theta ** powers * s).sum(axis=1)])[:n]

    def materialize(self, n: int) -> np.ndarray:
        c = self.toeplitz_coefs(n)
        i, j = np.indices((n, n))
        return np.where(i >= j, c[np.clip(i - j, 0, n - 1)], 0.0)

    def inverse(self) -> "BLT":
        """The BLT of C^{-1} (jax_privacy's ``BufferedToeplitz.inverse``: diagonalise Theta - omega 1^T)."""
        theta, omega = np.asarray(self.buf_decay, float), np.asarray(self.output_scale, float)
        if len(theta) > 1 and np.min(np.abs(np.diff(np.sort(theta)))) < 1e-9:
            raise WorkbenchError(f"BLT buf_decay {self.buf_decay} has values too close to invert")
        theta2 = np.diag(theta) - np.outer(omega, np.ones(len(theta)))
        evals = np.linalg.eigvals(theta2).real
        evecs = omega[:, None] / (evals - theta[:, None])
        einv = np.linalg.inv(evecs)
        if not np.allclose(evecs @ np.diag(evals) @ einv, theta2, atol=1e-7):
            raise WorkbenchError(f"the inverse of BLT {self} is numerically unstable")
        scale = (einv @ -omega) * (evecs.T @ np.ones(len(theta)))
        return canonical(evals, scale)


def canonical(buf_decay, output_scale) -> BLT:
    """Buffers ordered by decreasing buf_decay (jax_privacy's ``canonicalize``), as plain floats."""
    order = np.argsort(np.asarray(buf_decay, float))[::-1]
    return BLT(tuple(float(buf_decay[i]) for i in order), tuple(float(output_scale[i]) for i in order))


def rational_sqrt(num_buffers: int, max_buf_decay: float = 1 - 1e-6, max_pillutla_score: float = 1 - 1e-6) -> BLT:
    """jax_privacy's ``from_rational_approx_to_sqrt_x(num_buffers, max_buf_decay, max_pillutla_score)`` (defaults of
    its ``get_init_blt``): C^{-1} from a rational approximation of sqrt(1 - x), inverted."""
    d1 = (num_buffers + 1) // 2
    h = 1.6 * np.pi / np.sqrt(2 * (d1 + 1))
    ks = np.arange(-d1 + 1, num_buffers - d1 + 1) - 1
    decay = 1 / (1 + np.exp(2 * h * ks))
    scale = -(decay**2) * np.exp(3 * h * ks) / np.sum(np.exp(h * ks) * decay)
    blt = canonical(decay, scale).inverse()
    theta, s = np.asarray(blt.buf_decay), np.asarray(blt.output_scale)
    theta = theta * min(1.0, max_buf_decay / theta[0])
    s = s * min(1.0, max_pillutla_score / float(np.sum(s / theta)))
    return canonical(theta, s)


def sensitivity(blt: BLT, steps: int, min_sep: int) -> np.ndarray:
    """sens(t) for t = 1..steps: the L2 sensitivity (units of C_clip) of the first t steps when an example takes part
    at most every ``min_sep`` steps (see the module's docstring). Refuses coefficients that are negative or rise."""
    c = blt.toeplitz_coefs(steps)
    if not np.all(np.isfinite(c)) or np.any(c < 0) or np.any(np.diff(c) > 0):
        raise WorkbenchError(f"BLT {blt} has Toeplitz coefficients that are negative or increasing within {steps} "
                             "steps: its min-separation sensitivity is not the one computed here")
    v = c.copy()
    for start in range(min_sep, steps, min_sep):  # v_i = v_{i-k} + c_i, one block of k at a time
        v[start:start + min_sep] += v[start - min_sep:start - min_sep + len(v[start:start + min_sep])]
    return np.sqrt(np.cumsum(v * v)) * (1 + SENSITIVITY_MARGIN)


def prefix_sum_error(blt: BLT, steps: int) -> float:
    """||A C^{-1}||_F^2, A the T x T prefix-sum matrix: A C^{-1} is Toeplitz with first column cumsum(C^{-1}'s
    coefficients), and row t's squared norm is the sum of that column's first t + 1 squares."""
    s = np.cumsum(blt.inverse().toeplitz_coefs(steps))
    return float(np.sum(np.cumsum(s * s)))


def loss(blt: BLT, steps: int, min_sep: int) -> float:
    """Mean squared prefix-sum error at sensitivity 1 (``LossFn.build_min_sep(n, 'mean', min_sep)``'s loss)."""
    return prefix_sum_error(blt, steps) / steps * float(sensitivity(blt, steps, min_sep)[-1]) ** 2


def _valid(blt: BLT) -> bool:
    """Theorem 1(a) of arXiv:2504.21413's class (jax_privacy's penalties): decays in (0, 1), scales > 0, the inverse's
    decays in (0, 1) and scales < 0; with them the coefficients are positive and decreasing."""
    try:
        inv = blt.inverse()
    except (WorkbenchError, np.linalg.LinAlgError):
        return False
    th, s, ith, iscale = (np.asarray(x) for x in (blt.buf_decay, blt.output_scale, inv.buf_decay, inv.output_scale))
    return bool(np.all((th > 0) & (th < 1) & (s > 0)) and np.all((ith > 0) & (ith < 1) & (iscale < 0))
                and s.sum() < 1 and np.sum(s / th) < 1)


def strategy(num_buffers: int, steps: int, min_sep: int, optimize: bool = True) -> BLT:
    """The run's BLT (see the module's docstring); the start is kept when the optimiser does not improve on it."""
    if not (isinstance(num_buffers, int) and not isinstance(num_buffers, bool) and 1 <= num_buffers <= 16):
        raise WorkbenchError(f"privacy.blt_buffers must be an integer in [1, 16], got {num_buffers!r}")
    start = rational_sqrt(num_buffers)
    best, best_loss = start, loss(start, steps, min_sep)
    if optimize and steps > 1:
        from scipy.optimize import minimize

        def objective(x: np.ndarray) -> float:
            blt = canonical(x[:num_buffers], x[num_buffers:])
            if not _valid(blt):
                return 1e30
            try:
                return math.log(loss(blt, steps, min_sep))
            except WorkbenchError:
                return 1e30

        x0 = np.concatenate([start.buf_decay, start.output_scale])
        # Nelder-Mead: the feasible set's walls (objective 1e30 outside) stall L-BFGS-B's finite-difference line search
        found = minimize(objective, x0, method="Nelder-Mead", options={"maxiter": 200 * num_buffers,
                                                                        "xatol": 1e-8, "fatol": 1e-6})
        candidate = canonical(found.x[:num_buffers], found.x[num_buffers:])
        if np.all(np.isfinite(found.x)) and _valid(candidate):
            value = loss(candidate, steps, min_sep)
            if value < best_loss:
                best, best_loss = candidate, value
    return best


def check_blt(buf_decay, output_scale, num_buffers: int) -> BLT:
    """A checkpoint's or cache's BLT parameters, refused unless they are d finite numbers each."""
    blt = BLT(tuple(float(v) for v in buf_decay), tuple(float(v) for v in output_scale))
    if len(blt.buf_decay) != num_buffers or len(blt.output_scale) != num_buffers \
            or not all(math.isfinite(v) for v in blt.buf_decay + blt.output_scale):
        raise WorkbenchError(f"BLT parameters {blt} are not {num_buffers} finite buf_decay and output_scale values")
    return blt
