"""The noise of DP-SGD (docs/DESIGN.md, step 3): Gaussian noise of standard deviation sigma C added to the clipped
sum by rank 0 alone, before the step's one all-reduce, so that it is in the cluster-wide sum exactly once. It is drawn
on every logical step, whatever the batch (an empty Poisson draw releases pure noise), from the secret noise stream
of (seed, step): a resumed run draws exactly the noise the uninterrupted run would have drawn.

With adaptive clipping (clipping/adaptive.py) C is the step's C_t, sigma the raised gradient multiplier sigma_g, and
:class:`CountNoise` adds N(0, sigma_b^2) to the clipped count's slot of the same buffer, from its own secret stream,
also by rank 0 alone before the same all-reduce."""

from __future__ import annotations

import torch

from workbench.privacy.sampling import COUNT_NOISE_STREAM, NOISE_STREAM, step_generator


class GaussianNoise:
    """Adds N(0, (sigma C S)^2) to a flat update on rank 0; on other ranks, or with sigma = 0, adds nothing.

    ``seed`` is the run's secret noise seed (workbench/privacy/sampling.py, ``stream_seed``); it is set once the secret
    is known (a resumed run takes its checkpoint's). S is the loss scale the clipped sum carries (fp16)."""

    def __init__(self, noise_multiplier: float, max_grad_norm: float, numel: int, rank: int,
                 device: torch.device | str = "cpu", seed: int = 0):
        self.sigma, self.clip, self.numel, self.rank, self.seed = noise_multiplier, max_grad_norm, numel, rank, seed
        self.adds = self.sigma > 0 and self.rank == 0
        self._buffer = torch.empty(numel if self.adds else 0, device=device)  # reused: no allocation per step

    def add_(self, update: torch.Tensor, step: int, scale: float = 1.0) -> None:
        """Add this step's noise to ``update`` (a flat view of the parameters' clipped sum) in place."""
        if not self.adds:
            return
        g = step_generator(self.seed, 0, step, stream=NOISE_STREAM, device=update.device)
        noise = torch.randn(self.numel, generator=g, device=update.device, out=self._buffer)
        update.add_(noise.mul_(self.sigma * self.clip * scale))  # mul_, not add_'s alpha: refuses past float32's range


class CountNoise:
    """Adds N(0, sigma_b^2) to the clipped count (a 0-d slot of the step's flat buffer) on rank 0; nothing elsewhere.
    Its own stream (``COUNT_NOISE_STREAM``) of the run's secret noise seed: independent of the gradient's noise, and
    replayed exactly by a resumed run. Not multiplied by the loss scale: the count is not a gradient."""

    def __init__(self, std: float, rank: int, seed: int = 0):
        self.std, self.rank, self.seed = std, rank, seed
        self.adds = self.std > 0 and self.rank == 0

    def add_(self, slot: torch.Tensor, step: int) -> None:
        if not self.adds:
            return
        g = step_generator(self.seed, 0, step, stream=COUNT_NOISE_STREAM, device=slot.device)
        slot.add_(torch.randn((), generator=g, device=slot.device).mul_(self.std))  # no host read: stays on the device
