"""Batch selection (workbench/privacy/sampling.py): shards, the secret per-rank streams and the Poisson sampler, whose
draws are checked against the laws the accountant charges for."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.errors import WorkbenchError
from workbench.privacy.sampling import PoissonBatchSampler, Shard, seed_sequence_64, step_generator, train_shard


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
# one check under a fresh seed. They make 8 kinds x 10 checks + 8 = 88 checks: a false alarm under fresh seeds has
# probability below 88 * ALPHA < 1e-3 (union bound), and the fixed seeds make each run here the same.
ALPHA = 1e-5


def _two_sided_chi2(statistic: float, dof: int) -> float:
    from scipy import stats

    return 2 * min(stats.chi2.cdf(statistic, dof), stats.chi2.sf(statistic, dof))


def _old_bernoulli_mask(n: int, q: float, seed: int, rank: int, step: int) -> np.ndarray:
    """The sampler before issue 44, as a reference: one float32 uniform per unit from the step's torch stream, u < q."""
    return (torch.rand(n, generator=step_generator(seed, rank, step)) < q).numpy()


def _user_index(users: int):
    from workbench.privacy.users import index_users

    sizes = np.random.default_rng(1).integers(1, 6, size=users)  # users of 1..5 examples, interleaved
    return index_users(np.random.default_rng(2).permutation(np.repeat(np.arange(users), sizes)).tolist(), 3, 0)


def _draws(kind: str, steps: int, seed: int = 3) -> tuple[np.ndarray, float]:
    """(row, trial, unit) -> drawn?, and the rate q: every (row, unit) is one Bernoulli(q) per trial, all independent
    if the sampler is right. Rows are ranks (cyclic: rank x part, whose trials are the steps of that part)."""
    from workbench.privacy.cyclic import CyclicPoissonBatchSampler, banded_shard
    from workbench.privacy.users import UserCyclicSampler, UserPoissonSampler, user_shard

    world, n, batch, bands = {"per_rank": (2, 400, 20, 1), "small": (1, 20, 10, 1), "dense": (1, 50, 40, 1),
                              "global": (3, 200, 20, 1), "cyclic": (2, 800, 10, 4), "user": (1, 200, 20, 1),
                              "user_cyclic": (2, 400, 10, 2), "old": (1, 200, 20, 1)}[kind]
    mode = "global" if kind == "global" else "per_rank"
    index = _user_index(n) if kind.startswith("user") else None
    rows = []
    for rank in range(world):
        shard = user_shard(index, rank, world, mode, batch) if index else train_shard(n, rank, world, mode, batch)
        if bands > 1:
            shard = banded_shard(shard, bands, world)
        q, size = shard.sample_rate, len(shard.indices)
        if kind == "old":
            rows.append(np.stack([_old_bernoulli_mask(size, q, seed, rank, t) for t in range(steps)]))
            continue
        if kind == "cyclic":
            sampler = CyclicPoissonBatchSampler(shard, bands, steps, seed, rank)
        elif kind == "user_cyclic":
            sampler = UserCyclicSampler(shard, bands, steps, seed, rank, index)
        elif index:
            sampler = UserPoissonSampler(shard, steps, seed, rank, index)
        else:
            sampler = PoissonBatchSampler(shard, steps, seed, rank)
        drawn = np.zeros((steps, size), dtype=bool)
        for t in range(steps):
            batch_of = sampler.users_for_step(t) if index else sampler.indices_for_step(t)
            assert batch_of == sorted(set(batch_of))  # ascending, distinct: the order the loader was always given
            drawn[t, np.asarray(batch_of, dtype=np.int64) - shard.indices.start] = True
        if bands > 1:  # row per part: part k is drawn at steps k, k + b, ...; never at another step
            parts = drawn.reshape(steps // bands, bands, size // bands, bands)  # (trial, step's part, slot, part)
            assert not parts.transpose(0, 2, 1, 3)[:, :, ~np.eye(bands, dtype=bool)].any()
            rows.extend(parts[:, k, :, k] for k in range(bands))
        else:
            rows.append(drawn)
    return np.stack(rows), q


KINDS = ("per_rank", "small", "dense", "global", "cyclic", "user", "user_cyclic", "old")
STEPS = 4000
_cache: dict = {}


def _drawn(kind: str) -> tuple[np.ndarray, float]:
    if kind not in _cache:
        _cache[kind] = _draws(kind, STEPS)
    return _cache[kind]


def _binomial_goodness_of_fit(values: np.ndarray, trials: int, p: float, bins: int = 10) -> float:
    """Chi-square p-value of iid values against Binomial(trials, p), in bins of about equal probability."""
    from scipy import stats

    edges = np.unique(stats.binom.ppf(np.linspace(0, 1, bins + 1)[1:-1], trials, p))  # upper ends of bins but the last
    expected = np.diff(np.concatenate([[0.0], stats.binom.cdf(edges, trials, p), [1.0]])) * len(values)
    observed = np.bincount(np.searchsorted(edges, values, side="left"), minlength=len(expected))
    return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("kind", KINDS)
def test_each_example_is_included_binomial_t_q_times(kind):
    """Counts over T trials ~ Binomial(T, q), iid across units (examples or users, of every rank and part): a fixed
    or rotating subset, a skipped index, or a shuffle that balances the counts (sampling without replacement) fails."""
    drawn, q = _drawn(kind)
    trials = drawn.shape[1]
    counts = drawn.sum(1).ravel()
    assert _binomial_goodness_of_fit(counts, trials, q) > ALPHA
    dispersion = ((counts - trials * q) ** 2).sum() / (trials * q * (1 - q))  # ~ chi2(n): too small is as wrong as big
    assert _two_sided_chi2(dispersion, len(counts)) > ALPHA


@pytest.mark.parametrize("kind", KINDS)
def test_pairs_of_examples_are_included_together_q_squared_of_the_time(kind):
    """Independence between units and between trials: over disjoint pairs (neighbours, a random pairing, and one
    unit at two consecutive trials of its own) the co-inclusion count ~ Binomial(pairs, q^2), the pairs iid (exact,
    since they share no draw)."""
    from scipy import stats

    drawn, q = _drawn(kind)
    units = drawn.transpose(1, 0, 2).reshape(drawn.shape[1], -1)  # (trial, every unit of every row)
    n = units.shape[1] - units.shape[1] % 2
    for order in (np.arange(n), np.random.default_rng(0).permutation(n)):
        together = (units[:, order[0::2]] & units[:, order[1::2]]).sum(0)
        trials = units.shape[0]
        assert stats.binomtest(int(together.sum()), together.size * trials, q * q).pvalue > ALPHA
        dispersion = ((together - trials * q * q) ** 2).sum() / (trials * q * q * (1 - q * q))
        assert _two_sided_chi2(dispersion, len(together)) > ALPHA
    again = units[0::2] & units[1::2]  # trials 2j and 2j+1 of one unit: disjoint pairs of trials
    assert stats.binomtest(int(again.sum()), again.size, q * q).pvalue > ALPHA


@pytest.mark.parametrize("kind", KINDS)
def test_the_batch_size_is_binomial_n_q(kind):
    """Each rank's (each part's) batch size ~ Binomial(n, q), iid over steps: a count of Binomial(n - 1, q), draws
    with replacement (fewer distinct than drawn) or a batch of fixed size fail."""
    from scipy import stats

    drawn, q = _drawn(kind)
    n = drawn.shape[2]
    sizes = drawn.sum(2).ravel()
    assert _binomial_goodness_of_fit(sizes, n, q) > ALPHA
    mean_z = (sizes.mean() - n * q) / np.sqrt(n * q * (1 - q) / sizes.size)
    assert 2 * stats.norm.sf(abs(mean_z)) > ALPHA
    variance = ((sizes - n * q) ** 2).sum() / (n * q * (1 - q))  # the spread of a Binomial: ~ chi2(steps)
    assert _two_sided_chi2(variance, sizes.size) > ALPHA


@pytest.mark.parametrize("kind", ("per_rank", "small", "dense"))
def test_the_sampler_and_the_old_bernoulli_mask_are_indistinguishable(kind):
    """Two-sample tests against the sampler before issue 44 (a uniform per example), drawn from other steps of the
    same streams: the batch sizes' and the per-example counts' distributions are homogeneous (chi-square)."""
    from scipy import stats

    drawn, q = _drawn(kind)
    drawn = drawn[0]
    steps, n = drawn.shape
    old = np.stack([_old_bernoulli_mask(n, q, 3, 0, STEPS + t) for t in range(steps)])
    sizes = np.stack([np.bincount(drawn.sum(1), minlength=n + 1), np.bincount(old.sum(1), minlength=n + 1)])
    sizes = sizes[:, sizes.sum(0) >= 10]  # cells with enough mass for the chi-square
    assert stats.chi2_contingency(sizes).pvalue > ALPHA
    assert stats.chi2_contingency(np.stack([drawn.sum(0), old.sum(0)])).pvalue > ALPHA


def test_the_rate_is_q_at_a_billion_examples_in_o_batch_memory():
    """n = 1e9, q = 1e-9: about one example a step, the rate the accountant charges for (the old float32 uniform
    kept u < q at rate 2^-24 = 60 q here), drawn in memory of the batch, not of n."""
    import tracemalloc

    from scipy import stats

    shard = Shard(range(10**9), 10**9, 1e-9, 0, 1)
    sampler = PoissonBatchSampler(shard, steps=3000, seed=5, rank=0)
    tracemalloc.start()
    sizes = [len(b) for b in sampler]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert stats.binomtest(sum(sizes), 3000 * 10**9, 1e-9).pvalue > ALPHA
    assert peak < 2**20


def test_global_shard_multiplicity_is_binomial_w_q():
    """shard=global: each rank samples all N independently, so an example's multiplicity in a step is
    K ~ Binomial(W, q_r) - the mixture the accountant charges for (docs/DESIGN.md)."""
    from scipy import stats

    drawn, q_r = _drawn("global")
    world_size = drawn.shape[0]
    multiplicity = drawn.sum(0).ravel()  # one value per (step, example), independent
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
