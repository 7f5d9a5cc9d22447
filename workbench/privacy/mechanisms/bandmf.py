"""``privacy.mechanism=bandmf``: DP-FTRL by banded matrix factorization (correlated.py). The shard recut into b cyclic
parts drawn at the in-band rate p (cyclic.py), the b-banded strategy's coefficients (``strategy``), its noise
sigma C (C^{-1} Z)_t (correlated.BandedNoise), and the accountant of amplified BandMF (accounting/banded.py):
ceil(T / b) participations, calibrated and cut to the budget as DP-SGD's."""

from __future__ import annotations

from typing import Any

import torch

from workbench import cache
from workbench.privacy.accounting import Accountant
from workbench.privacy.accounting.banded import BandMFAccountant, participations
from workbench.privacy.correlated import BandedNoise
from workbench.privacy.correlated import strategy as banded_strategy
from workbench.privacy.cyclic import CyclicPoissonBatchSampler, banded_shard
from workbench.privacy.mechanisms.base import Get, Mechanism, correlated_settings, register
from workbench.privacy.mechanisms.dpsgd import DPSGD
from workbench.privacy.sampling import Shard


class BandMF(DPSGD):
    name = "bandmf"
    user_level = True  # cyclic Poisson over users (users.py's UserCyclicSampler)
    independent_noise = False

    def size(self, get: Get, shard_mode: str) -> int:
        return correlated_settings(self.name, "num_bands", "cyclic Poisson", get, shard_mode)

    def check_accountant(self, p: Any, world_size: int, shard_mode: str) -> None:
        pass  # BandMFAccountant asks its shard mode in size's refusal's words; any world size

    def recut(self, shard: Shard, size: int, world_size: int) -> Shard:
        return banded_shard(shard, size, world_size)

    def counted(self, steps: int, size: int) -> int:
        return participations(steps, size)  # T steps cost DP-SGD's ceil(T / b): calibrated as those

    def accountant(self, p: Any, shard: Shard, sigma: float, size: int, world_size: int, shard_mode: str) -> Accountant:
        return BandMFAccountant(p.accountant, shard.sample_rate, sigma, size, world_size, shard_mode)

    def finish(self, m: Mechanism, size: int, unit: str) -> Mechanism:
        if m.shard.dropped:
            m.notes.append(f"privacy.mechanism=bandmf uses {m.shard.population} {unit} ({m.shard.dropped} dropped) so "
                           f"that each rank's shard splits into {size} equal cyclic parts")
        coefficients = cache.cached("bandmf_strategy", lambda: banded_strategy(size, m.steps), num_bands=size,
                                    steps=m.steps, code=cache.code_version(("privacy/correlated.py",), ("scipy",)))
        m.num_bands, m.strategy = size, tuple(coefficients)
        return m

    def sampler(self, m: Mechanism, seed: int, rank: int, start_step: int) -> Any:
        return CyclicPoissonBatchSampler(m.shard, m.num_bands, m.steps, seed, rank, start_step)

    def event_fields(self, m: Mechanism) -> dict[str, Any]:
        return {"mechanism": "bandmf", "num_bands": m.num_bands}

    def accountant_of(self, fields: dict[str, Any], kind: str) -> Accountant:
        return BandMFAccountant(kind, fields["sample_rate"], fields["noise_multiplier"], fields["num_bands"],
                                fields["world_size"], fields["shard"])

    def noise(self, m: Mechanism, numel: int, rank: int, device: torch.device | str, seed: int,
              dtype: torch.dtype) -> BandedNoise:
        return BandedNoise(m.strategy, m.gradient_noise_multiplier, m.max_grad_norm, numel, rank, device, seed, dtype)

    def whole_set_poisson(self, m: Mechanism) -> bool:
        return False  # an example's cyclic part is its index mod b


register(BandMF())
