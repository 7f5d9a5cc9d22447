"""Batch selection (workbench/privacy/sampling.py): shards, the secret per-rank streams and the Poisson sampler, whose
draws are checked against the laws the accountant charges for."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.errors import WorkbenchError
from workbench.privacy.sampling import PoissonBatchSampler, seed_sequence_64, step_generator, train_shard


def test_poisson_sampler_rate_matches_q():
    shard = train_shard(2000, 0, 1, "per_rank", 100)
    sampler = PoissonBatchSampler(shard, steps=400, seed=0, rank=0)
    sizes = np.array([len(b) for b in sampler])
    q = shard.sample_rate
    assert q == pytest.approx(0.05)
    # Batch size ~ Binomial(2000, 0.05): mean 100, std ~9.7; the mean of 400 draws is within 4 standard errors.
    assert abs(sizes.mean() - 100) < 4 * np.sqrt(2000 * q * (1 - q) / 400)
    assert sizes.std() == pytest.approx(np.sqrt(2000 * q * (1 - q)), rel=0.15)
    # Each example independently: inclusion frequency per example ~ q.
    counts = np.zeros(2000)
    for b in PoissonBatchSampler(shard, steps=400, seed=0, rank=0):
        counts[b] += 1
    assert abs(counts.mean() / 400 - q) < 0.005


def test_sampler_is_reproducible_and_resumable():
    shard = train_shard(500, 0, 1, "per_rank", 50)
    a = list(PoissonBatchSampler(shard, steps=20, seed=7, rank=0))
    b = list(PoissonBatchSampler(shard, steps=20, seed=7, rank=0))
    resumed = list(PoissonBatchSampler(shard, steps=20, seed=7, rank=0, start_step=12))
    other_seed = list(PoissonBatchSampler(shard, steps=20, seed=8, rank=0))
    assert a == b
    assert resumed == a[12:]
    assert a != other_seed


def test_rank_streams_are_independent():
    g0 = [torch.rand(1000, generator=step_generator(3, 0, s)) for s in range(5)]
    g1 = [torch.rand(1000, generator=step_generator(3, 1, s)) for s in range(5)]
    for x, y in zip(g0, g1):
        assert abs(float(torch.corrcoef(torch.stack([x, y]))[0, 1])) < 0.15
    assert not torch.equal(g0[0], g0[1])


def test_per_rank_shards_are_disjoint_and_trimmed():
    shards = [train_shard(1001, r, 3, "per_rank", 10) for r in range(3)]
    union = sorted(i for s in shards for i in s.indices)
    assert union == list(range(999))
    assert all(s.dropped == 2 and s.population == 999 for s in shards)
    assert shards[0].sample_rate == pytest.approx(30 / 999)


def test_global_shard_rate():
    s = train_shard(1000, 1, 4, "global", 25)
    assert list(s.indices) == list(range(1000))
    assert s.sample_rate == pytest.approx(100 / (4 * 1000))


def test_batch_larger_than_dataset_and_empty_are_refused():
    with pytest.raises(WorkbenchError, match="larger than the training set"):
        train_shard(100, 0, 1, "per_rank", 101)
    with pytest.raises(WorkbenchError, match="empty"):
        train_shard(0, 0, 1, "per_rank", 1)


# The statistical tests below are seeded (deterministic here); ALPHA is the chance that a correct Poisson sampler fails
# one check under a fresh seed. With 7 checks the false-alarm rate of these tests is below 7 * ALPHA = 7e-4 (union bound).
ALPHA = 1e-4


def _two_sided_chi2(statistic: float, dof: int) -> float:
    from scipy import stats

    return 2 * min(stats.chi2.cdf(statistic, dof), stats.chi2.sf(statistic, dof))


def _inclusions(n=200, per_device_batch=20, steps=2000, seed=3, world_size=1, mode="per_rank"):
    """(rank, step, example) -> included?, from the real sampler of every rank."""
    out = np.zeros((world_size, steps, n), dtype=bool)
    for rank in range(world_size):
        shard = train_shard(n, rank, world_size, mode, per_device_batch)
        for step, batch in enumerate(PoissonBatchSampler(shard, steps=steps, seed=seed, rank=rank)):
            out[rank, step, batch] = True
    return out, shard.sample_rate


def _binomial_goodness_of_fit(values: np.ndarray, trials: int, p: float, bins: int = 10) -> float:
    """Chi-square p-value of iid values against Binomial(trials, p), in bins of about equal probability."""
    from scipy import stats

    edges = np.unique(stats.binom.ppf(np.linspace(0, 1, bins + 1)[1:-1], trials, p))  # upper ends of bins but the last
    expected = np.diff(np.concatenate([[0.0], stats.binom.cdf(edges, trials, p), [1.0]])) * len(values)
    observed = np.bincount(np.searchsorted(edges, values, side="left"), minlength=len(expected))
    return stats.chisquare(observed, expected).pvalue


def test_each_example_is_included_binomial_t_q_times():
    """Counts over T steps ~ Binomial(T, q), iid across examples: a fixed or rotating subset, or a shuffle that
    balances the counts (sampling without replacement), fails."""
    included, q = _inclusions()
    steps = included.shape[1]
    counts = included[0].sum(0)
    assert _binomial_goodness_of_fit(counts, steps, q) > ALPHA
    dispersion = ((counts - steps * q) ** 2).sum() / (steps * q * (1 - q))  # ~ chi2(n): too small is as wrong as too big
    assert _two_sided_chi2(dispersion, len(counts)) > ALPHA


def test_pairs_of_examples_are_included_together_q_squared_of_the_time():
    """Independence between examples: over disjoint pairs (neighbours, and a random pairing) the co-inclusion count
    ~ Binomial(T, q^2), iid across pairs (exact, since the pairs share no example)."""
    from scipy import stats

    included, q = _inclusions()
    steps, n = included.shape[1:]
    for order in (np.arange(n), np.random.default_rng(0).permutation(n)):
        a, b = order[0::2], order[1::2]
        together = (included[0][:, a] & included[0][:, b]).sum(0)
        assert stats.binomtest(int(together.sum()), len(together) * steps, q * q).pvalue > ALPHA
        dispersion = ((together - steps * q * q) ** 2).sum() / (steps * q * q * (1 - q * q))
        assert _two_sided_chi2(dispersion, len(together)) > ALPHA


def test_global_shard_multiplicity_is_binomial_w_q():
    """shard=global: each rank samples all N independently, so an example's multiplicity in a step is
    K ~ Binomial(W, q_r) - the mixture the accountant charges for (docs/DESIGN.md)."""
    from scipy import stats

    world_size = 3
    included, q_r = _inclusions(steps=500, world_size=world_size, mode="global")
    multiplicity = included.sum(0).ravel()  # one value per (step, example), independent
    expected = stats.binom.pmf(np.arange(world_size + 1), world_size, q_r) * len(multiplicity)
    assert stats.chisquare(np.bincount(multiplicity, minlength=world_size + 1), expected).pvalue > ALPHA


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1), st.integers(0, 2**140)), min_size=1,
                max_size=7))
def test_the_seed_derivation_is_numpys_seed_sequence_bit_for_bit(entropy):
    # every stream (batches, noise, secrets) is seeded this way: a resumed run, an older run's checkpoint and any
    # independent check that recomputes the noise with numpy must all see the same seeds
    state = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    assert seed_sequence_64(entropy) == int(state[0]) << 32 | int(state[1])


def test_numpy_and_torch_integers_seed_as_the_python_integers_they_hold():
    entropy = [2**63 + 5, 0, 7, 1]
    expected = seed_sequence_64(entropy)
    assert seed_sequence_64([np.uint64(2**63 + 5), np.int64(0), torch.tensor(7), 1]) == expected
    assert isinstance(expected, int) and expected >= 0


def test_a_negative_seed_is_refused_as_numpy_refuses_it():
    with pytest.raises(ValueError):
        np.random.SeedSequence([-1])
    with pytest.raises(ValueError, match="non-negative"):
        seed_sequence_64([5, -1])
