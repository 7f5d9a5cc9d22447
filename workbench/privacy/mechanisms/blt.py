"""``privacy.mechanism=blt``: DP-FTRL with a Buffered Linear Toeplitz strategy (privacy/blt.py). The shard recut into
k fixed batches walked cyclically (cyclic.FixedBatchSampler), the BLT for (T, k, d) as ``strategy``, its noise by a
forward solve over d buffers (correlated.BLTNoise), and accounting/blt.py's accountant: one Gaussian of multiplier
sigma / sens(T), no amplification. Its epsilon grows with t through sens(t), so the budget stop is only ever at T
itself (a given sigma may cut it)."""

from __future__ import annotations

from typing import Any

import torch

from workbench import cache
from workbench.errors import WorkbenchError
from workbench.privacy.accounting import Accountant, code_version
from workbench.privacy.accounting.blt import BLTAccountant, blt_of, calibrate_blt
from workbench.privacy.blt import check_blt
from workbench.privacy.blt import strategy as blt_strategy
from workbench.privacy.correlated import BLTNoise
from workbench.privacy.cyclic import FixedBatchSampler, fixed_batch_shard
from workbench.privacy.mechanisms.base import (Get, Mechanism, MechanismSpec, budget, clip_schedule,
                                               correlated_settings, register)
from workbench.privacy.sampling import Shard


class BLTMechanism(MechanismSpec):
    name = "blt"

    def size(self, get: Get, shard_mode: str) -> int:
        size = correlated_settings(self.name, "blt_buffers", "fixed batches", get, shard_mode, most=16)
        if get("unit", "example") != "example":
            raise WorkbenchError("privacy.mechanism=blt supports privacy.unit=example only (its fixed batches over "
                                 "users are not built); use privacy.mechanism=dpsgd or bandmf for user-level DP")
        return size

    def recut(self, shard: Shard, size: int, world_size: int) -> Shard:
        return fixed_batch_shard(shard, world_size)

    def make(self, p: Any, shard: Shard, shard_mode: str, world_size: int, steps: int, delta: float,
             notes: list[str], size: int, unit: str) -> Mechanism:
        """k fixed batches, the BLT for (T, k, d), sigma for target_epsilon after T steps."""
        k = round(1 / shard.sample_rate)
        blt = check_blt(*cache.cached("blt_strategy", lambda: _blt_params(size, steps, k), buffers=size,
                                      steps=steps, min_sep=k,
                                      code=cache.code_version(("privacy/blt.py",), ("scipy",))), size)
        sigma = p.noise_multiplier if p.noise_multiplier is not None else cache.cached(
            "calibrate_blt", lambda: calibrate_blt(p.accountant, blt, k, steps, p.target_epsilon, delta, world_size),
            kind=p.accountant, blt=[blt.buf_decay, blt.output_scale], min_sep=k, steps=steps,
            target_epsilon=p.target_epsilon, delta=delta, world_size=world_size, code=code_version())
        accountant = BLTAccountant(p.accountant, sigma, blt, k, steps, world_size, shard_mode)
        steps = budget(p, accountant, delta, steps, notes)
        if shard.dropped:
            notes.append(f"privacy.mechanism=blt uses {shard.population} examples ({shard.dropped} dropped) so that "
                         f"each rank's shard splits into {k} fixed batches of {shard.expected_batch // world_size}")
        return Mechanism(shard, shard_mode, world_size, steps, p.max_grad_norm, sigma, delta, accountant, notes,
                         clip_schedule(p, shard.expected_batch), self.name, k, blt)

    def sampler(self, m: Mechanism, seed: int, rank: int, start_step: int) -> Any:
        return FixedBatchSampler(m.shard, m.world_size, m.steps, seed, rank, start_step)

    def event_fields(self, m: Mechanism) -> dict[str, Any]:
        """The accountant's whole event: its BLT, k and the T its sensitivity was computed for."""
        a = m.accountant
        return dict(mechanism="blt", min_sep=a.min_sep, buf_decay=list(a.blt.buf_decay),
                    output_scale=list(a.blt.output_scale), strategy_steps=a.planned_steps)

    def accountant_of(self, fields: dict[str, Any], kind: str) -> Accountant:
        return BLTAccountant(kind, fields["noise_multiplier"], blt_of(fields), fields["min_sep"],
                             fields["strategy_steps"], fields["world_size"], fields["shard"])

    def noise(self, m: Mechanism, numel: int, rank: int, device: torch.device | str, seed: int,
              dtype: torch.dtype) -> BLTNoise:
        return BLTNoise(m.strategy, m.gradient_noise_multiplier, m.max_grad_norm, numel, rank, device, seed, dtype)


def _blt_params(buffers: int, steps: int, min_sep: int) -> list[list[float]]:
    blt = blt_strategy(buffers, steps, min_sep)
    return [list(blt.buf_decay), list(blt.output_scale)]


register(BLTMechanism())
