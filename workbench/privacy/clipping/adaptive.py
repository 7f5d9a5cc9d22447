"""The clip norm's schedule: fixed C, or adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy, "Differentially
Private Learning with Adaptive Clipping", NeurIPS 2021), where C follows a target quantile gamma of the per-example
norms, estimated privately from a noised count released with the gradient.

GradientStep asks the schedule for C_t before each step (``value``) and, after the step's one all-reduce, hands it the
released count (``update``); every rank sees the same released count, so C_t is identical on every rank.

The adaptive step (every example i of the step's Poisson batch, on every rank):

- each example adds ``1[example i not scaled down at C_t] - 1/2`` to one more slot of the step's flat buffer: its
  clip factor is 1, i.e. the certified bound on the norm of what it adds is within C_t (clipping/bound.py); an example
  taking the float64 route counts when its float64 norm is. The shift by 1/2 (the paper's) makes every example's
  contribution +-1/2: sensitivity 1/2 under adding or removing one example, and no use of the realised batch size,
  which is private under Poisson sampling;
- rank 0 adds N(0, sigma_b^2) to that slot (noise.py, its own secret stream) before the all-reduce, with the gradient
  noise N(0, (sigma_g C_t)^2) on the gradient slots;
- released: S = sum_i (b_i - 1/2) + N(0, sigma_b^2). The estimated unclipped fraction is b_t = S / B + 1/2 (B the
  expected batch; unbiased, since E[n] = B) and C_{t+1} = C_t exp(-eta_C (b_t - gamma)) (the geometric update).

Privacy (the paper's Theorem 1, in the add/remove form used here). Scale the gradient slots by 1 / (sigma_g C_t) and
the count by 1 / sigma_b: the noise is N(0, I) and one example moves the released vector by (g / (sigma_g C_t),
+-1/(2 sigma_b)), of squared norm at most sigma_g^-2 + (2 sigma_b)^-2 = sigma^-2. A Gaussian mechanism of unit noise
and sensitivity 1/sigma is the Gaussian mechanism of multiplier sigma; Poisson subsampling (and the parallel-Poisson
multiplicities of shard=global, which move along the same direction) acts on it exactly as on fixed-C DP-SGD, and C_t
is a function of earlier releases (adaptive composition). So the run is accounted as fixed-C DP-SGD at sigma, and the
gradient noise is raised to sigma_g = (sigma^-2 - (2 sigma_b)^-2)^-1/2, which needs 2 sigma_b > sigma.
"""

from __future__ import annotations

import math
from typing import Any

from workbench.errors import WorkbenchError

DEFAULT_TARGET_QUANTILE = 0.5  # the paper's median
DEFAULT_CLIP_LEARNING_RATE = 0.2  # the paper's eta_C (geometric update)
COUNT_NOISE_PER_EXAMPLE = 1 / 20  # the paper's sigma_b = m / 20 (m: expected examples per step): b_t's std 0.05


def default_count_noise(expected_batch: float) -> float:
    """sigma_b when ``privacy.clip_count_noise`` is not set: B / 20, as the paper sets it."""
    return expected_batch * COUNT_NOISE_PER_EXAMPLE


def gradient_noise_multiplier(sigma: float, count_noise: float) -> float:
    """sigma_g such that the gradient (sigma_g) and the half-sensitivity count (sigma_b) together are the Gaussian
    mechanism of multiplier ``sigma``: sigma_g = (sigma^-2 - (2 sigma_b)^-2)^-1/2. Raises WorkbenchError when
    2 sigma_b <= sigma (the count alone would spend the whole budget)."""
    if not 2 * count_noise > sigma:
        raise WorkbenchError(
            f"privacy.clip_count_noise={count_noise:g} is too small for noise_multiplier={sigma:.4g}: adaptive clipping "
            f"needs 2 x clip_count_noise > noise_multiplier (else the count alone spends the budget); set it above "
            f"{sigma / 2:.4g}, e.g. the paper's B/20")
    return (sigma ** -2 - (2 * count_noise) ** -2) ** -0.5


def composed_noise_multiplier(gradient_sigma: float, count_noise: float) -> float:
    """The inverse: the single Gaussian mechanism's multiplier (sigma_g^-2 + (2 sigma_b)^-2)^-1/2 (Theorem 1)."""
    return (gradient_sigma ** -2 + (2 * count_noise) ** -2) ** -0.5


class FixedClip:
    """C for every step (``privacy.clipping=fixed``): the gradient noise is sigma itself; nothing is counted."""

    adaptive = False
    count_noise = 0.0

    def __init__(self, clip: float):
        self.value = float(clip)

    def gradient_noise(self, sigma: float) -> float:
        return sigma

    def update(self, released: float) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        pass


class AdaptiveClip:
    """C_t of ``privacy.clipping=adaptive``: starts at ``initial`` (privacy.max_grad_norm) and follows the target
    quantile by the geometric update from each step's released, noised, shifted count (module docstring)."""

    adaptive = True

    def __init__(self, initial: float, target_quantile: float = DEFAULT_TARGET_QUANTILE,
                 learning_rate: float = DEFAULT_CLIP_LEARNING_RATE, count_noise: float | None = None,
                 expected_batch: float = 1.0):
        if not (0 < target_quantile < 1):
            raise WorkbenchError(f"privacy.target_quantile must be in (0, 1), got {target_quantile}")
        if not (learning_rate > 0 and math.isfinite(learning_rate)):
            raise WorkbenchError(f"privacy.clip_learning_rate must be a finite number > 0, got {learning_rate}")
        count_noise = default_count_noise(expected_batch) if count_noise is None else count_noise
        if not (count_noise >= 0 and math.isfinite(count_noise)):
            raise WorkbenchError(f"privacy.clip_count_noise must be a finite number > 0, got {count_noise}")
        if not (initial > 0 and math.isfinite(initial)):
            raise WorkbenchError(f"privacy.max_grad_norm (the initial C) must be a finite number > 0, got {initial}")
        self.value = float(initial)
        self.target_quantile, self.learning_rate = float(target_quantile), float(learning_rate)
        self.count_noise, self.expected_batch = float(count_noise), float(expected_batch)
        self.fraction: float | None = None  # the last step's estimated unclipped fraction b_t (released)

    def gradient_noise(self, sigma: float) -> float:
        return gradient_noise_multiplier(sigma, self.count_noise)

    def update(self, released: float) -> None:
        """C_{t+1} = C_t exp(-eta_C (b_t - gamma)), b_t = released / B + 1/2; ``released`` is the all-reduced noised
        shifted count S (identical on every rank, so C is too)."""
        self.fraction = released / self.expected_batch + 0.5
        self.value *= math.exp(-self.learning_rate * (self.fraction - self.target_quantile))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (C_t is released: a function of the noised counts, safe to publish)."""
        return {"clip_norm": self.value}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state or "clip_norm" not in state:
            raise WorkbenchError("the checkpoint has no adaptive clip norm (written by a fixed-C run?); refusing to "
                                 "resume privacy.clipping=adaptive from it")
        self.value = float(state["clip_norm"])
