"""``privacy.mechanism=dpsgd``: DP-SGD. Poisson sampling at q over the shard (sampling.py), per-example clipping to C
(or adaptive clipping's C_t), independent Gaussian noise sigma_g C per step (noise.py), accounted as the
Poisson-subsampled Gaussian self-composed T times (accounting/accountant.py), sigma calibrated to target_epsilon by
that same accountant."""

from __future__ import annotations

from typing import Any

import torch

from workbench import cache
from workbench.privacy.accounting import Accountant, calibrate_noise, code_version
from workbench.privacy.mechanisms.base import Mechanism, MechanismSpec, budget, clip_schedule, register
from workbench.privacy.noise import GaussianNoise
from workbench.privacy.sampling import PoissonBatchSampler, Shard


class DPSGD(MechanismSpec):
    name = "dpsgd"
    user_level = True
    independent_noise = True

    def check_accountant(self, p: Any, world_size: int, shard_mode: str) -> None:
        Accountant(p.accountant, 1.0, 1.0, world_size, shard_mode)

    def counted(self, steps: int, size: int) -> int:
        """The steps its accountant counts for ``steps`` steps (bandmf: the participations)."""
        return steps

    def accountant(self, p: Any, shard: Shard, sigma: float, size: int, world_size: int, shard_mode: str) -> Accountant:
        return Accountant(p.accountant, shard.sample_rate, sigma, world_size, shard_mode)

    def make(self, p: Any, shard: Shard, shard_mode: str, world_size: int, steps: int, delta: float,
             notes: list[str], size: int, unit: str) -> Mechanism:
        counted = self.counted(steps, size)
        sigma = p.noise_multiplier if p.noise_multiplier is not None else cache.cached(
            "calibrate_noise", lambda: calibrate_noise(p.accountant, shard.sample_rate, counted, p.target_epsilon,
                                                       delta, world_size, shard_mode),
            kind=p.accountant, sample_rate=shard.sample_rate, steps=counted, target_epsilon=p.target_epsilon,
            delta=delta, world_size=world_size, shard=shard_mode, code=code_version())
        accountant = self.accountant(p, shard, sigma, size, world_size, shard_mode)
        steps = budget(p, accountant, delta, steps, notes)
        clip = clip_schedule(p, shard.expected_batch)
        clip.gradient_noise(sigma)  # refused here, before any run exists, when the count's noise is too small
        return self.finish(Mechanism(shard, shard_mode, world_size, steps, p.max_grad_norm, sigma, delta, accountant,
                                     notes, clip, self.name), size, unit)

    def finish(self, m: Mechanism, size: int, unit: str) -> Mechanism:
        """What a variant adds to the calibrated plan (bandmf: its strategy)."""
        return m

    def sampler(self, m: Mechanism, seed: int, rank: int, start_step: int) -> Any:
        return PoissonBatchSampler(m.shard, m.steps, seed, rank, start_step)

    def event_fields(self, m: Mechanism) -> dict[str, Any]:
        return {}  # the event of the accountant's fields alone (a dpsgd tag has always been without "mechanism")

    def accountant_of(self, fields: dict[str, Any], kind: str) -> Accountant:
        return Accountant(kind, fields["sample_rate"], fields["noise_multiplier"], fields["world_size"],
                          fields["shard"])

    def noise(self, m: Mechanism, numel: int, rank: int, device: torch.device | str, seed: int,
              dtype: torch.dtype) -> GaussianNoise:
        return GaussianNoise(m.gradient_noise_multiplier, m.max_grad_norm, numel, rank, device, seed)

    def whole_set_poisson(self, m: Mechanism) -> bool:
        return m.shard_mode == "global" or m.world_size == 1


register(DPSGD())
