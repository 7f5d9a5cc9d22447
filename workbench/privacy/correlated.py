"""Correlated noise: DP-FTRL by banded matrix factorization, BandMF (issue 22; Choquette-Choo et al., "Amplified
Banded Matrix Factorization", NeurIPS 2023; McKenna 2024).

The strategy. C is a lower-triangular, b-banded Toeplitz matrix (b = ``privacy.num_bands``) with coefficients
c_0..c_{b-1} on its diagonals, normalised to ||c||_2 = 1. Column i of C is non-zero only in rows i..i+b-1, so
columns b or more apart are orthogonal: an example that takes part at most once every b steps (cyclic Poisson,
sampling.py's neighbour below) contributes column norm <= 1 per participation, orthogonally. That is the sensitivity
1 of the amplified-BandMF analysis, under which the mechanism is DP-SGD's Poisson(p)-subsampled Gaussian(sigma)
self-composed ceil(T/b) times (accounting/banded.py).

The coefficients (:func:`strategy`): the run's T and b pick them. We start from the first b coefficients of the
square root of the prefix-sum matrix (the binomial series of (1 - x)^(-1/2): 1, 1/2, 3/8, 5/16, ...; Fichtenberger et
al. 2023, the strategy banded Toeplitz optimisers start from) and minimise the total squared error of the
prefix-sum workload A (the lower-triangular matrix of ones: what SGD's iterates are), ||A C^{-1}||_F^2 at sensitivity 1,
over the b coefficients (L-BFGS with the exact gradient below; T x b work per evaluation). Why this loss: it is the
one the BandMF papers optimise for training (the model after t steps is a prefix sum of the noised gradients), it
is cheap for Toeplitz C, and the optimum is never worse than the start (kept when the optimiser does not improve it).
The coefficients are public (they depend on T and b only) and saved in the checkpoint, so a resume uses the very
same ones.

The noise (:class:`BandedNoise`): step t adds sigma C_clip (C^{-1} Z)_t, Z's rows the fresh N(0, I) draws of the run's
secret noise stream (the same stream DP-SGD's noise draws from, noise.py), by back-substitution
w_t = (z_t - sum_{j=1}^{b-1} c_j w_{t-j}) / c_0, on rank 0 alone, before the step's one all-reduce. Memory: a ring
of the last b-1 w's plus one draw, b x (the trainable parameters' count) numbers in their dtype: O(b x model). The
ring is secret (with it the past updates' noise could be subtracted): it goes into the run folder's checkpoint,
never to MLflow (run.py's PRIVATE_STATE). With b = 1 the noise is DP-SGD's, bit for bit.

BLT (``privacy.mechanism=blt``; the strategy, its sensitivity and its participation are blt.py's) adds, with
:class:`BLTNoise`, sigma C_clip (C^{-1} Z)_t from the same secret stream by a forward solve of C x = z over d
buffers (O(d x model), checkpointed and secret like the ring). A run's plan builds its own
(mechanisms/bandmf.py, mechanisms/blt.py: Mechanism.noise); :func:`correlated_noise` picks one by the strategy.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from workbench.errors import WorkbenchError
from workbench.privacy.blt import BLT, check_blt
from workbench.privacy.sampling import NOISE_STREAM, step_generator

def sqrt_coefficients(num_bands: int) -> np.ndarray:
    """The first b coefficients of (1 - x)^(-1/2): c_0 = 1, c_j = c_{j-1} (2j - 1) / (2j)."""
    c = np.ones(num_bands)
    for j in range(1, num_bands):
        c[j] = c[j - 1] * (2 * j - 1) / (2 * j)
    return c


def _inverse_series(c: np.ndarray, n: int, power: int = 1) -> np.ndarray:
    """The first n coefficients of 1 / C(x)^power, C(x) = sum_j c_j x^j (the first column of C^{-power})."""
    from scipy.signal import lfilter

    impulse = np.zeros(n)
    impulse[0] = 1.0
    out = lfilter([1.0], c, impulse)
    return lfilter([1.0], c, out) if power == 2 else out


def prefix_sum_error(c: np.ndarray, steps: int) -> float:
    """||A C^{-1}||_F^2 with C the banded Toeplitz of c normalised to unit column norm (sensitivity 1), A the T x T
    prefix-sum matrix. A C^{-1} is Toeplitz with first column s = cumsum(d), d the inverse series: row k of it
    appears T - k times."""
    return _loss_and_grad(np.asarray(c, float), steps)[0]


def _loss_and_grad(c: np.ndarray, steps: int) -> tuple[float, np.ndarray]:
    n, b = steps, len(c)
    weights = np.arange(n, 0, -1, dtype=float)  # T - k
    s = np.cumsum(_inverse_series(c, n))
    big_e = np.cumsum(_inverse_series(c, n, power=2))  # d/dc_j of d_k is -e_{k-j}: 1/C(x)^2's series
    norm2 = float(c @ c)
    ws = weights * s
    raw = float(ws @ s)
    # d raw / d c_j = -2 sum_{k >= j} w_k s_k E_{k-j}
    d_raw = np.array([-2.0 * float(ws[j:] @ big_e[:n - j]) if j < n else 0.0 for j in range(b)])  # c_j, j >= T: unseen
    return norm2 * raw, 2.0 * c * raw + norm2 * d_raw


def strategy(num_bands: int, steps: int, optimize: bool = True) -> tuple[float, ...]:
    """The b coefficients of the run's strategy, unit norm and c_0 > 0 (see the module's docstring)."""
    if not (isinstance(num_bands, int) and num_bands >= 1):
        raise WorkbenchError(f"privacy.num_bands must be an integer >= 1, got {num_bands!r}")
    start = sqrt_coefficients(num_bands)
    best = start
    if optimize and num_bands > 1 and steps > 1:
        from scipy.optimize import minimize

        found = minimize(_loss_and_grad, start, args=(steps,), jac=True, method="L-BFGS-B",
                         options={"maxiter": 200})
        x = np.asarray(found.x, float)
        if np.all(np.isfinite(x)) and x[0] > 0 and prefix_sum_error(x, steps) < prefix_sum_error(start, steps):
            best = x
    c = [float(v) for v in best / np.linalg.norm(best)]
    while math.fsum(v * v for v in c) > 1.0:  # sensitivity <= 1 exactly as the floats stand, not up to rounding
        c = [v * (1.0 - 2.0**-52) for v in c]
    return tuple(c)


def check_coefficients(c: Any, num_bands: int) -> tuple[float, ...]:
    """Refuse coefficients that would not have sensitivity <= 1 (norm above 1) or cannot be inverted (c_0 <= 0)."""
    c = tuple(float(v) for v in c)
    if len(c) != num_bands or not all(math.isfinite(v) for v in c) or c[0] <= 0 \
            or math.fsum(v * v for v in c) > 1.0:
        raise WorkbenchError(f"bandmf coefficients {c!r} are not {num_bands} finite numbers with c_0 > 0 and norm <= 1")
    return c


class _StreamedNoise:
    """What BandedNoise and BLTNoise share: noise.GaussianNoise's interface (``seed``, ``clip``, ``adds``, ``add_``),
    buffers kept between steps on rank 0 alone (empty elsewhere), and steps asked in order from the resumed one."""

    def __init__(self, name: str, rows: int, noise_multiplier: float, max_grad_norm: float, numel: int, rank: int,
                 device: torch.device | str, seed: int, dtype: torch.dtype):
        self.name = name
        self.sigma, self.clip, self.numel, self.rank, self.seed = noise_multiplier, max_grad_norm, numel, rank, seed
        self.adds = self.sigma > 0 and self.rank == 0
        size = numel if self.adds else 0
        self._draw = torch.empty(size, device=device, dtype=dtype)
        self.kept = torch.zeros(rows, size, device=device, dtype=dtype)  # secret: past noise, zero at step 0
        self.next_step = 0

    @property
    def memory_bytes(self) -> int:
        """What the noise keeps between steps and draws into (bandmf: b x numel elements; blt: (d + 1) x numel)."""
        return (self.kept.numel() + self._draw.numel()) * self._draw.element_size()

    def _fresh(self, update: torch.Tensor, step: int) -> torch.Tensor:
        """Step ``step``'s fresh N(0, I) draw z_t, from the run's secret noise stream (refused out of order)."""
        if step != self.next_step:
            raise WorkbenchError(f"{self.name} noise asked for step {step} but its buffers are at step {self.next_step}")
        g = step_generator(self.seed, 0, step, stream=NOISE_STREAM, device=update.device)
        return torch.randn(self.numel, generator=g, device=update.device, out=self._draw)


class BandedNoise(_StreamedNoise):
    """Adds sigma C S (C^{-1} Z)_t to the flat update on rank 0 (nothing on other ranks, or with sigma = 0).

    Same interface as noise.GaussianNoise (``seed``, ``clip``, ``adds``, ``add_``), plus the checkpointed ring
    (``state_dict``/``load_state_dict``). Steps must come in order from the resumed step on: the ring holds the
    previous b-1 steps' w, so a skipped or repeated step is refused rather than silently mis-correlated."""

    def __init__(self, coefficients: tuple[float, ...], noise_multiplier: float, max_grad_norm: float, numel: int,
                 rank: int, device: torch.device | str = "cpu", seed: int = 0, dtype: torch.dtype = torch.float32):
        self.c = check_coefficients(coefficients, len(coefficients))
        super().__init__("bandmf", len(self.c) - 1, noise_multiplier, max_grad_norm, numel, rank, device, seed, dtype)
        self.ring = self.kept  # w_{t-1}..w_{t-b+1}, slot t mod (b-1)

    def add_(self, update: torch.Tensor, step: int, scale: float = 1.0) -> None:
        if not self.adds:
            return
        w = self._fresh(update, step)
        slots = len(self.c) - 1
        for j in range(1, min(step, slots) + 1):  # w_{t-j} for t - j >= 0 (the matrix starts at step 0)
            w.sub_(self.ring[(step - j) % slots], alpha=self.c[j])
        if self.c[0] != 1.0:
            w.div_(self.c[0])
        if slots:
            self.ring[step % slots].copy_(w)
        self.next_step = step + 1
        update.add_(w.mul_(self.sigma * self.clip * scale))

    def state_dict(self) -> dict[str, Any]:
        """The ring (secret), the next step and the coefficients (public): the checkpoint's ``correlated_noise``."""
        return {"coefficients": list(self.c), "next_step": self.next_step, "ring": self.ring.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Continue at ``step`` from a checkpoint's ``correlated_noise`` (rank 0 needs it; the others ignore it)."""
        if not self.adds:
            self.next_step = step
            return
        if not state or "ring" not in state:
            raise WorkbenchError("the checkpoint has no bandmf noise buffer (written by another mechanism, or by a rank "
                                 "that adds no noise); a bandmf run resumes only from its rank 0's checkpoint")
        c = check_coefficients(state["coefficients"], len(self.c))
        ring = state["ring"]
        if int(state["next_step"]) != step or tuple(ring.shape) != tuple(self.ring.shape):
            raise WorkbenchError(f"the checkpoint's bandmf noise buffer (step {state['next_step']}, shape "
                                 f"{tuple(ring.shape)}) does not fit step {step} and shape {tuple(self.ring.shape)}")
        self.c = c  # the ones the run started with (an optimiser elsewhere may differ in the last bits)
        self.ring.copy_(ring.to(self.ring.device, self.ring.dtype))
        self.next_step = step


class BLTNoise(_StreamedNoise):
    """Adds sigma C_clip (C^{-1} Z)_t to the flat update on rank 0, C the BLT ``blt`` (blt.py), by solving C x = z
    forward with C's own parameters (Algorithm 3 of arXiv:2408.08868): x_t = z_t - sum_i s_i u_i, then
    u_i <- theta_i u_i + x_t, so u_i = sum_{j<t} theta_i^(t-1-j) x_j. Same interface and step-order rule as
    BandedNoise; its d buffers are the checkpoint's secret ``correlated_noise``."""

    def __init__(self, blt: BLT, noise_multiplier: float, max_grad_norm: float, numel: int, rank: int,
                 device: torch.device | str = "cpu", seed: int = 0, dtype: torch.dtype = torch.float32):
        self.blt = check_blt(blt.buf_decay, blt.output_scale, len(blt.buf_decay))
        self.decay, self.scale = self.blt.buf_decay, self.blt.output_scale
        super().__init__("blt", len(self.decay), noise_multiplier, max_grad_norm, numel, rank, device, seed, dtype)
        self.buffers = self.kept  # u_1..u_d

    def add_(self, update: torch.Tensor, step: int, scale: float = 1.0) -> None:
        if not self.adds:
            return
        x = self._fresh(update, step)
        for i, s in enumerate(self.scale):  # x_t = z_t - (C's row t below the diagonal) . x_{<t}
            x.sub_(self.buffers[i], alpha=s)
        for i, theta in enumerate(self.decay):
            self.buffers[i].mul_(theta).add_(x)
        self.next_step = step + 1
        update.add_(x.mul_(self.sigma * self.clip * scale))

    def state_dict(self) -> dict[str, Any]:
        """The buffers (secret), the next step and the BLT's parameters (public)."""
        return {"buf_decay": list(self.blt.buf_decay), "output_scale": list(self.blt.output_scale),
                "next_step": self.next_step, "buffers": self.buffers.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Continue at ``step`` from a checkpoint's ``correlated_noise`` (rank 0 needs it; the others ignore it)."""
        if not self.adds:
            self.next_step = step
            return
        if not state or "buffers" not in state:
            raise WorkbenchError("the checkpoint has no blt noise buffers (written by another mechanism, or by a rank "
                                 "that adds no noise); a blt run resumes only from its rank 0's checkpoint")
        blt = check_blt(state["buf_decay"], state["output_scale"], len(self.decay))
        buffers = state["buffers"]
        if blt != self.blt or int(state["next_step"]) != step or tuple(buffers.shape) != tuple(self.buffers.shape):
            raise WorkbenchError(f"the checkpoint's blt noise buffers (step {state['next_step']}, shape "
                                 f"{tuple(buffers.shape)}, {blt}) do not fit step {step}, shape "
                                 f"{tuple(self.buffers.shape)} and {self.blt}")
        self.buffers.copy_(buffers.to(self.buffers.device, self.buffers.dtype))
        self.next_step = step


def correlated_noise(strategy: "tuple[float, ...] | BLT", *args, **kwargs) -> "BandedNoise | BLTNoise":
    """The correlated noise of a Mechanism's ``strategy``: BLT parameters or bandmf's coefficients."""
    return BLTNoise(strategy, *args, **kwargs) if isinstance(strategy, BLT) else BandedNoise(strategy, *args, **kwargs)
