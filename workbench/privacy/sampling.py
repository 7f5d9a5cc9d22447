"""Batch selection: which examples a rank may draw from (shard modes), the secret random streams, and the Poisson
sampler that draws every logical step's batch (the privacy contract of docs/DESIGN.md, "Sampling").

:class:`PoissonBatchSampler` draws each logical step's batch as an independent Bernoulli(q) choice per example, from
a stream seeded by (seed, rank, step). Being stateless per step, a resumed run draws exactly the batches the
uninterrupted run would have drawn. The noise draws from the same family of streams (``stream=NOISE_STREAM``).

The draw (:func:`poisson_subset`) costs O(expected batch) per step, not O(shard): a Binomial(n, q) count K, then K
distinct positions uniformly at random (README, "Large datasets"). :data:`SAMPLER` names it in every checkpoint.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from workbench.errors import WorkbenchError

SHARDS = ("per_rank", "global")
# `stream` of step_generator: the batch draws, the gradient noise, the clipped count's noise (adaptive clipping)
SAMPLING_STREAM, NOISE_STREAM, COUNT_NOISE_STREAM, PARTITION_STREAM = 0, 1, 2, 3  # 3: blt's fixed batches
# Which draw the Poisson samplers make from a step's stream; checkpoints record it, and a resume under another one is
# refused (job.py): it would draw other batches than the run it continues. Before it (no field): a float32 uniform per
# example, u < q, whose rate was ceil(q 2^24) / 2^24, not q.
SAMPLER = "binomial-distinct-v1"


@dataclass(frozen=True)
class Shard:
    """The examples one rank samples from, and the population the accountant sees."""

    indices: range
    population: int  # N_used: the N in the accounting
    sample_rate: float  # this rank's per-example Bernoulli rate
    dropped: int  # tail examples left out so that per-rank shards are equal
    expected_batch: int  # B = per_device_batch x world_size: the expected global batch the rate is set for


def train_shard(dataset_size: int, rank: int, world_size: int, mode: str, per_device_batch: int) -> Shard:
    """Shard modes of docs/DESIGN.md: per_rank = disjoint contiguous equal shards; global = every rank sees all N."""
    if dataset_size == 0:
        raise WorkbenchError("the training dataset is empty")
    global_batch = per_device_batch * world_size
    if mode == "per_rank":
        per_rank = dataset_size // world_size
        population = per_rank * world_size
        if per_rank == 0:
            raise WorkbenchError(f"the training set has {dataset_size} examples, fewer than world_size={world_size}")
        shard = Shard(range(rank * per_rank, (rank + 1) * per_rank), population, global_batch / population,
                      dataset_size - population, global_batch)
    elif mode == "global":
        population = dataset_size
        shard = Shard(range(dataset_size), population, global_batch / (world_size * dataset_size), 0, global_batch)
    else:
        raise WorkbenchError(f"ddp_shard={mode!r} is unknown; choose per_rank or global")
    if global_batch > population:
        raise WorkbenchError(
            f"the expected global batch per_device_train_batch_size x world_size = {global_batch} is larger than the "
            f"training set ({population} examples); lower per_device_train_batch_size"
        )
    return shard


_MASK = 0xFFFFFFFF


def seed_sequence_64(entropy: list[int]) -> int:
    """``np.random.SeedSequence(entropy).generate_state(2, np.uint32)`` as one 64-bit integer, bit for bit (numpy's
    hash mixing of O'Neill's seed_seq, pool of 4 words; tests/test_sampling.py checks it against numpy), in plain
    integer arithmetic: numpy's construction measured 150-220 us a call when its code has left the caches between
    steps (the noise and the sampler each derive one per step), this about half that."""
    words = []
    for v in map(operator.index, entropy):  # each as a Python int (a numpy or torch integer too), then its
        # little-endian 32-bit words (0: one word)
        if v < 0:
            raise ValueError(f"seed entropy must be non-negative, not {v}")
        words.append(v & _MASK)
        while v >> 32:
            v >>= 32
            words.append(v & _MASK)
    h = 0x43B0D7E5

    def hashmix(value: int) -> int:
        nonlocal h
        value ^= h
        h = h * 0x931E8875 & _MASK
        value = value * h & _MASK
        return value ^ value >> 16

    def mix(x: int, y: int) -> int:
        r = (0xCA01F9DD * x - 0x4973F715 * y) & _MASK
        return r ^ r >> 16

    pool = [hashmix(words[i] if i < len(words) else 0) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for word in words[4:]:
        for dst in range(4):
            pool[dst] = mix(pool[dst], hashmix(word))
    h, state = 0x8B51F9DD, []
    for i in range(2):
        v = pool[i] ^ h
        h = h * 0x58F38DED & _MASK
        v = v * h & _MASK
        state.append(v ^ v >> 16)
    return state[0] << 32 | state[1]


def stream_seed(secret: int, seed: int) -> int:
    """Mix the run's secret into a user-visible seed: batches and noise stay unpredictable to whoever knows the seed."""
    return seed_sequence_64([secret, seed])


def step_seed(seed: int, rank: int, step: int, stream: int = SAMPLING_STREAM) -> int:
    """The 64-bit seed of one (seed, rank, step) stream; `stream` separates uses (sampling, noise)."""
    return seed_sequence_64([seed, rank, step, stream])


def step_generator(seed: int, rank: int, step: int, stream: int = SAMPLING_STREAM, device: torch.device | str = "cpu") -> torch.Generator:
    """An independent, reproducible RNG stream for one (seed, rank, step); `stream` separates uses (sampling, noise)."""
    return torch.Generator(device=device).manual_seed(step_seed(seed, rank, step, stream))


def step_rng(seed: int, rank: int, step: int, stream: int = SAMPLING_STREAM) -> np.random.Generator:
    """The same stream's seed as a numpy Generator (PCG64): the Poisson draws' (:func:`poisson_subset`)."""
    return np.random.default_rng(step_seed(seed, rank, step, stream))


def _first_distinct(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """The first k distinct values of a stream of iid uniform integers on [0, n) (k <= n / 2: under 2k draws
    expected). The rule sees only which draws are equal, so relabelling [0, n) maps its output's law onto itself:
    the output is a uniformly random k-subset."""
    drawn = rng.integers(0, n, size=k)  # numpy's bounded integers are exactly uniform (Lemire's rejection, 64 bits)
    while True:
        values, first = np.unique(drawn, return_index=True)
        if len(values) >= k:
            return values if len(values) == k else values[np.argsort(first)[:k]]
        drawn = np.concatenate([drawn, rng.integers(0, n, size=k - len(values))])


def poisson_subset(n: int, q: float, rng: np.random.Generator) -> np.ndarray:
    """The positions in [0, n) kept by n independent Bernoulli(q) trials, ascending, in O(nq) time and memory.

    The kept set's size is K ~ Binomial(n, q) and, given K, the set is uniform over K-subsets (every K-subset has
    probability q^K (1-q)^(n-K)): so K from numpy's binomial (BTPE, or inversion below n min(q, 1-q) = 30; exact in
    64-bit n and float64 q up to rounding, its inversion's restart past 10 standard deviations drops < 1e-17), then a
    uniform K-subset, or the complement of a uniform (n-K)-subset when K > n / 2. torch's randint is not used: below
    2^32 it reduces 32 random bits mod n (a bias of up to n / 2^32), nor float uniforms (2^-24 or 2^-53 grids)."""
    k = int(rng.binomial(n, q))
    if 2 * k > n:
        kept = np.ones(n, dtype=bool)
        kept[_first_distinct(n, n - k, rng)] = False
        return np.flatnonzero(kept)
    return np.sort(_first_distinct(n, k, rng))


class PoissonBatchSampler:
    """Yields, for each logical step in [start_step, steps), the dataset indices of this rank's Poisson batch.

    Each example of the shard is included independently with probability ``shard.sample_rate``; empty batches are
    yielded too (the rank still joins the step's collective).
    """

    def __init__(self, shard: Shard, steps: int, seed: int, rank: int, start_step: int = 0):
        self.shard, self.steps, self.seed, self.rank, self.start_step = shard, steps, seed, rank, start_step

    def indices_for_step(self, step: int) -> list[int]:
        drawn = poisson_subset(len(self.shard.indices), self.shard.sample_rate, step_rng(self.seed, self.rank, step))
        return (drawn + self.shard.indices.start).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.steps):
            yield self.indices_for_step(step)

    def __len__(self) -> int:
        return max(0, self.steps - self.start_step)
