"""Cyclic Poisson sampling, the participation amplified BandMF is accounted for (correlated.py, accounting/banded.py).

Each rank's shard (``shard=per_rank``, any world size) is split into b parts, part k being the shard's examples
k, k+b, k+2b, ... (strided, so a dataset sorted by class gives every part every class; the split depends on indices
only, never on data). At step t every rank Poisson-samples part t mod b at rate p, from the same secret stream as
sampling.PoissonBatchSampler: an example can be drawn only at steps congruent to its part, so it takes part at most
once every b steps (b-min-separation), with probability p each time. Globally, step t's batch is part t mod b of the
whole population (the union of the ranks' parts), Poisson-sampled at p: one example in one part, as the analysis
assumes.

So that every part has the same size (and the expected global batch is exactly B = p x N_used / b), each rank's shard
is cut to a multiple of b: N_used = W b floor(N / (W b)); the extra examples dropped are counted in ``Shard.dropped``
and said in the run's notes. p = b B / N_used must be <= 1, else the run is refused (fewer bands or a smaller batch).
``shard=global`` (every rank sampling all N) is refused for bandmf: its parallel-Poisson multiplicity inside a band is
not analysed here.

BLT (``privacy.mechanism=blt``, blt.py) takes part by fixed batches, without amplification: each rank's shard,
permuted once by a secret permutation (the sampling stream's, so it is unknowable from the config), is cut into k
parts of exactly the per-device batch (k = the batches per epoch; the tail, less than one batch per rank, is dropped
and said in the notes), and step t takes part t mod k whole. An example takes part at steps s, s + k, s + 2k, ...:
at most ceil(T / k) times, k steps apart, which is the min-separation pattern blt.py's sensitivity is computed for.
The batch is public and fixed, B every step, so dividing by B is exact. ``shard=global`` is refused (every rank would
walk all N: an example would be in W batches of a step).
"""

from __future__ import annotations

from typing import Iterator

import torch

from workbench.errors import WorkbenchError
from workbench.privacy.sampling import PARTITION_STREAM, Shard, poisson_subset, step_generator, step_rng


def banded_shard(shard: Shard, num_bands: int, world_size: int) -> Shard:
    """``shard`` (per_rank) cut to a multiple of b examples per rank, with the in-band Poisson rate p = b B / N_used."""
    per_rank = len(shard.indices) // num_bands * num_bands
    if per_rank == 0:
        raise WorkbenchError(f"privacy.num_bands={num_bands} is more than the {len(shard.indices)} examples of a rank's "
                             "shard; lower privacy.num_bands")
    population = per_rank * world_size
    rate = num_bands * shard.expected_batch / population
    if rate > 1:
        most = len(shard.indices) // -(-shard.expected_batch // world_size)  # the largest b with B <= W floor(n / b)
        raise WorkbenchError(f"privacy.num_bands={num_bands} makes the in-band sampling rate b B / N = {rate:.3g} > 1 "
                             f"(B={shard.expected_batch}, N={population}); use privacy.num_bands <= {most} or a "
                             "smaller per_device_train_batch_size")
    rank = shard.indices.start // len(shard.indices)  # sampling.train_shard's per_rank shards: contiguous, equal
    start = rank * per_rank  # recut to per_rank examples each
    return Shard(range(start, start + per_rank), population, rate,
                 shard.dropped + shard.population - population, shard.expected_batch)


def part_of(index, num_bands: int):
    """The part of dataset index ``index`` (an int or an array): index mod b, on every rank, since each rank's shard
    starts at a multiple of b (banded_shard). An index past the population is in no shard: it is never drawn."""
    return index % num_bands


class CyclicPoissonBatchSampler:
    """Yields, for each logical step in [start_step, steps), this rank's Poisson(p) draw from part (step mod b) of its
    shard. Stateless per step (a resumed run draws the same batches); with b = 1 it is PoissonBatchSampler exactly."""

    def __init__(self, shard: Shard, num_bands: int, steps: int, seed: int, rank: int, start_step: int = 0):
        self.shard, self.num_bands, self.steps, self.seed = shard, num_bands, steps, seed
        self.rank, self.start_step = rank, start_step
        self.part_size = len(shard.indices) // num_bands

    def part(self, step: int) -> range:
        """The dataset indices of the part sampled at ``step``."""
        k = step % self.num_bands
        return range(self.shard.indices.start + k, self.shard.indices.start + k + self.num_bands * self.part_size,
                     self.num_bands)

    def indices_for_step(self, step: int) -> list[int]:
        drawn = poisson_subset(self.part_size, self.shard.sample_rate, step_rng(self.seed, self.rank, step))
        return (drawn * self.num_bands + self.part(step).start).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.steps):
            yield self.indices_for_step(step)

    def __len__(self) -> int:
        return max(0, self.steps - self.start_step)


def fixed_batch_shard(shard: Shard, world_size: int) -> Shard:
    """``shard`` (per_rank) cut to k x (per-device batch) examples per rank; its rate is 1 / k (each step takes one of
    its k parts, whole)."""
    batch = shard.expected_batch // world_size
    parts = len(shard.indices) // batch
    if parts == 0:
        raise WorkbenchError(f"privacy.mechanism=blt needs at least one full batch per rank: the per-device batch "
                             f"{batch} is more than a rank's {len(shard.indices)} examples")
    per_rank = parts * batch
    rank = shard.indices.start // len(shard.indices)  # sampling.train_shard's per_rank shards: contiguous, equal
    population = per_rank * world_size
    return Shard(range(rank * per_rank, (rank + 1) * per_rank), population, 1 / parts,
                 shard.dropped + shard.population - population, shard.expected_batch)


class FixedBatchSampler:
    """Yields, for each logical step in [start_step, steps), part (step mod k) of this rank's secretly permuted shard:
    exactly the per-device batch, the same examples every k steps. Stateless per step (a resumed run walks the same
    batches)."""

    def __init__(self, shard: Shard, world_size: int, steps: int, seed: int, rank: int, start_step: int = 0):
        self.batch = shard.expected_batch // world_size
        self.parts = len(shard.indices) // self.batch
        self.steps, self.start_step = steps, start_step
        g = step_generator(seed, rank, 0, stream=PARTITION_STREAM)
        self.order = (torch.randperm(len(shard.indices), generator=g) + shard.indices.start).tolist()

    def indices_for_step(self, step: int) -> list[int]:
        k = step % self.parts
        return sorted(self.order[k * self.batch:(k + 1) * self.batch])

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.steps):
            yield self.indices_for_step(step)

    def __len__(self) -> int:
        return max(0, self.steps - self.start_step)
