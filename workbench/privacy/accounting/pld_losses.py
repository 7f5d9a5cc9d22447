"""dp_accounting's Gaussian and mixture-of-Gaussians privacy losses, vectorised (the single-step PLDs of
:mod:`workbench.privacy`). Kept apart so that importing workbench.privacy does not import dp_accounting."""

from __future__ import annotations

import math
import numbers

import numpy as np
from dp_accounting.pld import privacy_loss_mechanism as _plm


class _VectorizedMixtureGaussianPrivacyLoss(_plm.MixtureGaussianPrivacyLoss):
    """``MixtureGaussianPrivacyLoss`` with its inverse-privacy-loss bisection run for all points at once.

    dp_accounting 0.6 bisects recursively in Python, one privacy-loss evaluation per tree node (seconds per PLD at
    W=8). Here every point runs the *same* bisection (same bounds, same midpoints, same comparisons, same stopping
    rule, same rounding) as a numpy array, so the resulting PLD is identical; ``tests/test_accounting.py`` checks it
    against the stock ``dp_accounting`` computation.
    """

    def _privacy_losses(self, xs: np.ndarray) -> np.ndarray:
        """``privacy_loss(x)`` for each x: the same terms, log-added left to right as ``np.logaddexp.reduce`` does."""
        sign = 1.0 if self.adjacency_type == _plm.AdjacencyType.ADD else -1.0
        acc = None
        for constant, sensitivity in zip(self._precompute_privacy_loss_constants, self.sensitivities):
            term = constant + sign * (sensitivity * xs / self._variance)
            acc = term if acc is None else np.logaddexp(acc, term)
        return -acc if sign > 0 else acc

    def _inverse_privacy_losses_with_range(self, privacy_losses, bounds, precision=1e-6):
        losses = np.asarray(privacy_losses, dtype=float)
        if len(losses) == 0:
            return []
        lo = np.full(losses.shape, float(bounds[0]))
        hi = np.full(losses.shape, float(bounds[1]))
        active = np.flatnonzero(hi - lo > precision)
        while active.size:
            mid = (lo[active] + hi[active]) / 2
            up = losses[active] < self._privacy_losses(mid)  # loss decreases in x: the inverse lies above mid
            lo[active[up]] = mid[up]
            hi[active[~up]] = mid[~up]
            active = active[hi[active] - lo[active] > precision]
        return np.floor(hi / precision) * precision


class _VectorizedGaussianPrivacyLoss(_plm.GaussianPrivacyLoss):
    """``GaussianPrivacyLoss`` whose ``get_delta_for_epsilon`` inverts all privacy losses as one numpy expression.

    dp_accounting 0.6 inverts them one by one in a Python list comprehension (most of the time spent building a
    Poisson PLD). The closed form is the library's own, term for term; values it special-cases (the ends of the
    range, a privacy loss of exactly 0, anything non-finite) go through the library's scalar method unchanged.
    """

    def _inverse_privacy_losses(self, losses: np.ndarray) -> np.ndarray:
        s, var, q = self.sensitivity, self._standard_deviation**2, self.sampling_prob
        remove = self.adjacency_type == _plm.AdjacencyType.REMOVE
        if q == 1.0:
            x = -0.5 * s - losses * var / s
            return x if remove else s + x
        # privacy loss without subsampling: +-log_a_times_exp_b_plus_c(1/q, +-loss, 1 - 1/q), a > 0 > c
        b = losses if remove else -losses
        d = b + np.log(1 / q)
        log_minus_c = np.log(-(1 - 1 / q))
        edge = math.log(1 - q) if remove else -math.log(1 - q)
        with np.errstate(all="ignore"):
            pl = d + np.log1p(-np.exp(log_minus_c - d))
            x = -0.5 * s - (pl if remove else -pl) * var / s
        special = (~np.isfinite(losses) | (b == 0) | (log_minus_c >= d)
                   | (np.abs(losses - edge) <= 1e-9 * np.maximum(np.abs(losses), abs(edge))))  # math.isclose
        if not remove:
            x = s + x
        for i in np.flatnonzero(special):
            x[i] = self.inverse_privacy_loss(float(losses[i]))
        return x

    def get_delta_for_epsilon(self, epsilon):
        # AdditiveNoisePrivacyLoss.get_delta_for_epsilon (ADD / REMOVE), with the inverses computed at once
        is_scalar = isinstance(epsilon, numbers.Number)
        epsilons = np.array([epsilon]) if is_scalar else np.asarray(epsilon)
        deltas = np.zeros_like(epsilons, dtype=float)
        if self.sampling_prob == 1.0:
            inverse_indices = np.full_like(epsilons, True, dtype=bool)
        elif self.adjacency_type == _plm.AdjacencyType.ADD:
            inverse_indices = epsilons < -math.log1p(-self.sampling_prob)
        elif self.adjacency_type == _plm.AdjacencyType.REMOVE:
            inverse_indices = epsilons > math.log1p(-self.sampling_prob)
            other_indices = np.logical_not(inverse_indices)
            deltas[other_indices] = -np.expm1(epsilons[other_indices])
        else:
            return super().get_delta_for_epsilon(epsilon)
        x_cutoffs = self._inverse_privacy_losses(np.asarray(epsilons[inverse_indices], dtype=float))
        deltas[inverse_indices] = (self.mu_upper_cdf(x_cutoffs)
                                   - np.exp(epsilons[inverse_indices] + self.mu_lower_log_cdf(x_cutoffs)))
        deltas = np.clip(deltas, 0, 1)
        return float(deltas[0]) if is_scalar else deltas
