"""User-level DP combined with adaptive clipping and with BandMF (issue 23): the clipped count over users and C's
trajectory against the per-user autograd oracle of tests/test_user_level.py, the count's noise std against sigma_b of
the users' batch, epsilon against dp_accounting over users, the float64 route counted per user, cyclic Poisson over
users, bit-exact resume with C in the checkpoint, and both through the real CLI."""

import math
from pathlib import Path
import shutil

import dp_accounting
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from tests.conftest import run_cli
from tests.test_user_level import _direct_epsilon, _model, _oracle, _Rows, _users_batch
from workbench.data.users import SyntheticUsers, user_ids
from workbench.distributed import setup
from workbench.privacy import DEFAULT_PLD_DISCRETIZATION
from workbench.privacy.clipping.adaptive import AdaptiveClip, gradient_noise_multiplier
from workbench.privacy.clipping.bound import RHO
from workbench.privacy.users import UserCyclicSampler, index_users, plan_users, user_shard
from workbench.user_step import UserGradientStep


def _privacy(**overrides):
    base = dict(enabled=True, accountant="pld", target_epsilon=None, target_delta=1e-5, noise_multiplier=1.1,
                max_grad_norm=1.0, clipping="adaptive", target_quantile=0.5, clip_learning_rate=0.2,
                clip_count_noise=None, mechanism="dpsgd", num_bands=4)
    return OmegaConf.create({**base, **overrides})


def _user_norms(x, y, sizes):
    """Each user's mean-gradient norm, from the oracle (float64 autograd, one example at a time), users alone."""
    norms, start = [], 0
    for size in sizes:
        mean, _ = _oracle(_model(), x[start:start + size], y[start:start + size], [size], 1e30)
        norms.append(float(torch.cat([m.flatten() for m in mean]).norm()))
        start += size
    return norms


# ------------------------------------------------------------------------------------------ user + adaptive


@pytest.mark.parametrize("mode, physical", [("hooks", 64), ("vmap", 5)])
def test_the_count_is_over_users_and_c_follows_a_hand_computation_from_the_per_user_norms(mode, physical):
    """No count noise: two steps, C_1 and C_2 from the oracle's per-user norms by the geometric update with B = the
    users' batch; each step's sum is the oracle's per-user clipped sum at that step's C."""
    sizes = [3, 1, 5, 2, 4, 1, 5]
    x, y = _users_batch(sizes)
    norms = sorted(_user_norms(x, y, sizes))
    c0 = (norms[1] + norms[2]) / 2  # 2 of 7 users within C_0 (by examples it would be another number)
    users, eta, gamma = len(sizes), 0.5, 0.5
    schedule = AdaptiveClip(c0, gamma, eta, 0.0, expected_batch=users)
    step = UserGradientStep(_model(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=c0,
                            noise_multiplier=0.0, grad_sample_mode=mode, max_physical_batch_size=physical,
                            clip_schedule=schedule)
    c = c0
    for t in range(2):
        assert not any(abs(n / c - 1) < 1e-3 for n in norms)  # no norm at the bound: the count is not a rounding call
        expected, clipped = _oracle(_model(), x, y, sizes, c)
        _, count = step(((x, y), sizes), step=t)
        assert count == sum(sizes)
        within = sum(n <= c for n in norms)
        assert within == users - clipped and 0 < within < users
        assert step.flat[-1].item() == within - users / 2  # one +-1/2 term per user
        for p, e in zip(step.params, expected):
            torch.testing.assert_close(p.grad.double(), e, rtol=1e-4, atol=1e-6)
        c = c * math.exp(-eta * (within / users - gamma))
        assert schedule.fraction == pytest.approx(within / users, abs=1e-12)
        assert schedule.value == pytest.approx(c, rel=1e-12)
    assert c != c0


def test_count_noise_is_sigma_b_of_the_users_batch_and_epsilon_is_the_fixed_c_user_run():
    ids = [u for u in range(600) for _ in range(1 + u % 3)]
    index = index_users(ids, cap=2, seed=0)
    shard = user_shard(index, 0, 1, "per_rank", 60)
    adaptive = plan_users(_privacy(), index, shard, "per_rank", 1, 200)
    fixed = plan_users(_privacy(clipping="fixed"), index, shard, "per_rank", 1, 200)
    assert adaptive.clipping.expected_batch == 60 and adaptive.clipping.count_noise == pytest.approx(60 / 20)
    sigma_g = adaptive.gradient_noise_multiplier
    assert sigma_g == pytest.approx((1.1 ** -2 - (2 * 3.0) ** -2) ** -0.5, rel=1e-12)
    eps = adaptive.epsilon(200)
    assert eps == fixed.epsilon(200) == pytest.approx(_direct_epsilon(60 / 600, 1.1, 200, 1e-5), rel=1e-6)
    fields = adaptive.event_fields()
    assert fields["unit"] == "user" and fields["clipping"] == "adaptive" and fields["noise_multiplier"] == 1.1
    # the count's released noise: empty steps, S = (b_t - 1/2) B, std sigma_b (400 draws: std's error ~3.5 %)
    step = UserGradientStep(nn.Linear(4, 3), nn.CrossEntropyLoss(reduction="none"), setup("gloo"),
                            max_grad_norm=1.0, noise_multiplier=sigma_g, clip_schedule=adaptive.clipping,
                            noise_seed=77)
    counts = []
    for t in range(400):
        step((None, []), step=t)
        counts.append((adaptive.clipping.fraction - 0.5) * 60)
    assert float(np.std(counts)) == pytest.approx(3.0, rel=0.12)
    assert abs(float(np.mean(counts))) < 4 * 3.0 / math.sqrt(400)


def test_the_float64_route_counts_a_user_once_and_the_bound_holds_per_user():
    """Adversarial users (a float32 sum that overflows; a non-finite one) take the float64 route: each user's
    contribution stays <= C (1 + RHO), and the count has one term per user whatever the route."""
    from workbench.data.batches import Batch
    from workbench.privacy.clipping.per_user import PerUser

    rows = torch.tensor([[3e38, 3e38], [3e38, 3e38], [0.25, 0.0], [float("inf"), 0.0], [0.5, 0.0], [0.1, 0.1]])
    sizes = [2, 1, 1, 2]  # huge (clipped), small (within), not finite (0: not within), small (within)
    param = nn.Parameter(torch.zeros(2))
    strategy = PerUser(_Rows(param, rows), clip=1.0)
    strategy.max_batch = 8
    strategy.unclipped = torch.zeros(())
    batch = Batch((), {}, torch.zeros(len(rows)))
    batch.user_sizes = sizes
    buffer = torch.zeros(2)
    strategy.accumulate(batch, None, {id(param): buffer})
    assert strategy.unclipped.item() == 2 - len(sizes) / 2
    huge = 2 ** -0.5  # the overflowing user clipped to C = 1 along (1, 1); the small users as they are
    torch.testing.assert_close(buffer, torch.tensor([huge + 0.25 + 0.3, huge + 0.05]), rtol=RHO, atol=1e-7)


def _resumed(make_cfg, *combined):
    """A user-level run of 8 steps, and the same run resumed from its step-4 checkpoint: (step 4's checkpoint, the
    last checkpoint of each, the epsilon of each)."""
    from workbench import checkpoint
    from workbench.run import train

    args = ["experiment=users", "tracking=off", "max_steps=8", "save_steps=4", "save_total_limit=10",
            "privacy.secure_seed=99", "privacy.max_examples_per_user=3", "max_physical_batch_size=16", *combined]
    whole = train(make_cfg(*args))
    cfg = make_cfg(*args, "resume_from_checkpoint=latest")
    folder = checkpoint.list_checkpoints(whole.output_dir)
    (tmp := Path(cfg.output_dir) / folder[0].parent.name).mkdir(parents=True)
    shutil.copy(folder[0], tmp / folder[0].name)  # resume from step 4
    resumed = train(cfg)
    a, b = checkpoint.load(folder[-1]), checkpoint.load(checkpoint.list_checkpoints(resumed.output_dir)[-1])
    assert a["step"] == b["step"] == 8
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["accountant"] == b["accountant"] and resumed.epsilon == whole.epsilon
    return checkpoint.load(folder[0]), a, b


def test_an_adaptive_user_level_run_resumes_bit_exact_with_c_in_the_checkpoint(make_cfg):
    first, a, b = _resumed(make_cfg, "privacy.clipping=adaptive", "privacy.max_grad_norm=0.2")
    assert first["clipping"]["clip_norm"] != 0.2 != a["clipping"]["clip_norm"]  # C moved
    assert a["clipping"] == b["clipping"]  # C_8, bit for bit


# ------------------------------------------------------------------------------------------ user + bandmf


def _bandmf_epsilon(p, sigma, steps, b, delta):
    """Amplified BandMF from dp_accounting directly: Poisson(p) Gaussian(sigma) composed ceil(T / b) times."""
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=DEFAULT_PLD_DISCRETIZATION)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(sigma)), math.ceil(steps / b)))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("world_size", [1, 2])
def test_bandmf_draws_users_in_strided_cyclic_parts_and_accounts_over_users(world_size):
    data = SyntheticUsers(num_users=203, seed=2)
    ids, _ = user_ids(data, "users")
    index = index_users(ids, cap=4, seed=0)
    b, steps, per_device = 4, 40, 5
    p = _privacy(clipping="fixed", mechanism="bandmf", num_bands=b)
    per_rank = len(index) // world_size // b * b  # each rank's users cut to a multiple of b
    rate = b * per_device * world_size / (per_rank * world_size)
    seen = {}
    for rank in range(world_size):
        m = plan_users(p, index, user_shard(index, rank, world_size, "per_rank", per_device), "per_rank",
                       world_size, steps)
        assert m.kind == "bandmf" and m.shard.population == per_rank * world_size
        assert m.sample_rate == pytest.approx(rate)
        if rank == 0:
            assert m.epsilon(steps) == pytest.approx(_bandmf_epsilon(rate, 1.1, steps, b, 1e-5), rel=1e-6)
        assert m.delta < 1 / len(index) and m.event_fields()["unit"] == "user"
        sampler = m.sampler(seed=5, rank=rank)
        assert isinstance(sampler, UserCyclicSampler)
        first = rank * per_rank  # cyclic.py's recut: the ranks' shards stay contiguous, the tail dropped
        for t in range(steps):
            drawn = sampler.users_for_step(t)
            assert all(first <= u < first + per_rank and (u - first) % b == t % b for u in drawn)  # part t mod b
            assert sampler.indices_for_step(t) == [i for u in drawn for i in index.examples[u]]  # all of a user's
            assert sampler.sizes_for_step(t) == [len(index.examples[u]) for u in drawn]
            for u in drawn:
                seen.setdefault(u, []).append(t)
    assert all(np.diff(ts).min() >= b for ts in seen.values() if len(ts) > 1)  # at most once every b steps
    draws = sum(len(ts) for ts in seen.values())
    expected = rate * per_rank * world_size * steps / b  # each user's part is sampled steps / b times
    assert abs(draws - expected) < 5 * math.sqrt(expected)


def test_a_bandmf_user_level_run_resumes_bit_exact(make_cfg):
    _resumed(make_cfg, "privacy.mechanism=bandmf", "privacy.num_bands=4")  # the cyclic users and the noise ring


# ------------------------------------------------------------------------------------------ through the CLI


# One CLI process (about 20 s of CPU): the bandmf combination, whose sampler and accountant differ most from the
# example level's; the adaptive one goes through the same compose and validation in test_an_adaptive_user_level_run_...
@pytest.mark.slow
@pytest.mark.parametrize("combined", [["privacy.mechanism=bandmf", "privacy.num_bands=4"]], ids=["bandmf"])
def test_a_user_level_cli_run_combines_and_reports_epsilon_per_user(tmp_path, combined):
    import json

    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("experiment=users", "disable_tqdm=true", "max_steps=12", *combined, cwd=tmp_path,
                   env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    m, tags = run.data.metrics, run.data.tags
    event = json.loads(tags["workbench.dp_event"])
    assert run.info.status == "FINISHED" and tags["privacy_unit"] == "user" and event["unit"] == "user"
    n_users = 1000
    assert m["delta"] < 1 / n_users and m["epsilon"] <= 8.0
    if "privacy.clipping=adaptive" in combined:
        assert event["clipping"] == "adaptive" and m["sample_rate"] == pytest.approx(64 / n_users)
        assert event["clip_count_noise"] == pytest.approx(64 / 20)  # B_users / 20
        direct = _direct_epsilon(m["sample_rate"], m["noise_multiplier"], int(m["steps"]), m["delta"])
    else:
        assert event["mechanism"] == "bandmf" and m["sample_rate"] == pytest.approx(4 * 64 / n_users)
        direct = _bandmf_epsilon(m["sample_rate"], m["noise_multiplier"], int(m["steps"]), 4, m["delta"])
    assert m["epsilon"] == pytest.approx(direct, rel=1e-6)
