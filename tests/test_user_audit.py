"""The one-run audit at user level (``audit=canaries`` with ``privacy.unit=user``): each canary is a canary user of one
example, appended after the data's users, sampled, clipped and noised as every user; the bound is on epsilon per user.
Checked: the canary users in the index and the data check's line (against counts made here from the raw data), the
batch order a user-level step relies on, real audited runs (a weakly private one is caught, 0 < bound <= epsilon per
user, epsilon equal to dp_accounting's with q = B / (N_users + m) computed here; at epsilon 1 per user the reported
epsilon stands; two ranks with shard=global see the same updates and account the Binomial(2, q_r) mixture; the audit
CLI says "per user"), a sweep's plan over users plus canary users, and the one-line refusals that remain."""

from collections import Counter
from statistics import median

import dp_accounting
import numpy as np
import pytest
import torch

from workbench.data.users import SyntheticUsers
from workbench.errors import WorkbenchError
from workbench.privacy import DEFAULT_PLD_DISCRETIZATION
from workbench.privacy.auditing.canaries import CanaryAudit, CanaryDataset
from workbench.privacy.users import CanaryUser, UserPoissonSampler, index_users, user_shard


def _direct_epsilon(q, sigma, steps, delta):
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=DEFAULT_PLD_DISCRETIZATION)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    return acc.get_epsilon(delta)


def test_canary_users_are_one_slot_each_after_the_data_users_and_left_out_of_the_sizes():
    data = SyntheticUsers(num_users=40, size_scale=30, in_features=4, num_classes=3)
    n, m = len(data), 25
    audit = CanaryAudit(m, data, 0.05)
    index = audit.users(index_users(data.users.tolist(), cap=3, seed=0))
    real = Counter(data.users.tolist())
    assert len(index) == len(real) + m and index.canaries == m
    assert index.users[len(real):] == [CanaryUser(j) for j in range(m)]
    assert not set(index.users[len(real):]) & set(real)  # never one of the data's users
    assert index.examples[len(real):] == [[n + j] for j in range(m)]  # canary user j holds slot j alone
    assert index.sizes[len(real):] == [1] * m
    sizes = list(real.values())
    expected = (f"privacy.unit=user: {len(real)} users, examples per user min {min(sizes)} / median {median(sizes):g} "
                f"/ max {max(sizes)}; privacy.max_examples_per_user=3 drops {sum(max(0, s - 3) for s in sizes)} of "
                f"{n} examples; audit=canaries adds {m} canary users of 1 example each ({len(real) + m} users sampled "
                "and accounted)")
    assert index.describe() == expected
    with pytest.raises(ValueError):
        audit.users(index)  # canary users are added once


def test_a_batch_of_drawn_users_comes_back_user_after_user_with_canaries_among_them():
    data = SyntheticUsers(num_users=30, size_scale=10, in_features=4, num_classes=3)
    audit = CanaryAudit(20, data, 0.05)
    members = audit.dataset.draw_membership(secret=5, seed=0)
    n = len(data)
    asked = [n + 3, 4, n + 0, 7, 2, n + 19]  # slots before ordinary examples: the order must hold
    x, y = audit.dataset.__getitems__(asked)
    for row, i in zip(x, asked):
        if i < n:
            assert row[-1] == 0 and torch.equal(row[:-1], data[i][0])
        else:
            j = i - n
            assert row[-1] == (j + 1 if members[j] else -1)
    # the sampler over users with canary users: each step's examples are its users' capped examples, in order
    index = audit.users(index_users(data.users.tolist(), cap=2, seed=0))
    sampler = UserPoissonSampler(user_shard(index, 0, 1, "global", 8), 5, seed=3, rank=0, index=index)
    drawn = [u for step in range(5) for u in sampler.users_for_step(step)]
    assert any(u >= len(index) - 20 for u in drawn)  # canary users are drawn like any user
    for step in range(5):
        got = sampler.indices_for_step(step)
        assert got == [i for u in sampler.users_for_step(step) for i in index.examples[u]]
        assert sum(sampler.sizes_for_step(step)) == len(got)
        if got:
            x, _ = audit.dataset.__getitems__(got)
            assert [int(v) != 0 for v in x[:, -1]] == [i >= n for i in got]  # slots where the users put them


def test_mapping_examples_keep_a_one_line_refusal():
    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": torch.ones(2), "labels": torch.tensor(0), "author": f"u{i}"}

    with pytest.raises(WorkbenchError, match=r"needs a training set of \(x, y\) examples") as e:
        CanaryDataset(Rows(), 10)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- real runs (slow: tens of seconds each)

# 1000 users + 1000 canary users, expected batch 256 users: q_user = 0.128 per step (as tests/test_audit.py's examples).
_RUN = ["experiment=users", "audit=canaries", "audit.canaries=1000", "per_device_train_batch_size=256",
        "privacy.secure_seed=11"]
_N_USERS = 1000  # SyntheticUsers(num_users=1000): every user has at least one example


@pytest.mark.slow
def test_a_weakly_private_user_level_run_is_caught_and_its_bound_stays_below_epsilon_per_user(make_cfg, mlflow_uri,
                                                                                            capsys):
    from mlflow import MlflowClient

    from workbench import audit, train

    result = train(make_cfg(*_RUN, "max_steps=80", "privacy.noise_multiplier=0.5", "privacy.target_epsilon=null"))
    a = result.audit
    assert a.unit == "user" and a.canaries == 1000
    q = 256 / (_N_USERS + 1000)
    assert result.sample_rate == pytest.approx(q)
    assert result.epsilon == pytest.approx(_direct_epsilon(q, 0.5, 80, result.delta), rel=1e-6)
    assert 0 < a.epsilon_lower_bound <= result.epsilon, a  # a valid lower bound, and the weak run is caught
    assert a.epsilon_lower_bound > 3 and a.ideal_lower_bound > 3, a
    client = MlflowClient(tracking_uri=mlflow_uri)
    run = client.get_run(result.run_id)
    assert run.data.tags["privacy_unit"] == "user"
    m = run.data.metrics
    assert m["audit_epsilon_lower_bound"] == pytest.approx(a.epsilon_lower_bound) and m["audit_canaries"] == 1000
    # the bound is recomputable from its logged inputs
    assert a.epsilon_lower_bound == pytest.approx(audit.epsilon_lower_bound(
        1000, int(m["audit_guesses"]), int(m["audit_correct"]), m["delta"], m["audit_significance"] / m["audit_tests"]))
    out = capsys.readouterr().out
    assert f"audit: epsilon>={a.epsilon_lower_bound:.3f} per user" in out
    assert "audit=canaries adds 1000 canary users of 1 example each (2000 users sampled and accounted)" in out


@pytest.mark.slow
def test_at_epsilon_one_per_user_the_reported_epsilon_stands(make_cfg):
    from workbench import train

    result = train(make_cfg(*_RUN, "max_steps=40", "privacy.target_epsilon=1", "tracking=off"))
    a = result.audit
    assert result.epsilon == pytest.approx(1.0, abs=0.01)
    assert result.epsilon == pytest.approx(_direct_epsilon(256 / (_N_USERS + 1000), result.noise_multiplier, 40,
                                                           result.delta), rel=1e-6)
    assert a.unit == "user" and a.epsilon_lower_bound < 1 and a.p_value_of_reported > 0.05, a
    assert np.isfinite(a.ideal_lower_bound) and a.ideal_lower_bound < 1


def test_a_sweep_plans_an_audited_user_level_point_over_users_and_canary_users():
    from workbench import compose
    from workbench.job import planned_mechanism

    fields = planned_mechanism(compose(["experiment=users", "audit=canaries", "audit.canaries=500", "tracking=off"]))
    n_users = len(SyntheticUsers(num_users=1000, seed=0).users.unique())
    assert fields["unit"] == "user" and fields["sample_rate"] == pytest.approx(64 / (n_users + 500))
    assert fields["delta"] < 1 / (n_users + 500)


@pytest.mark.slow
def test_the_audit_cli_says_per_user(tmp_path):
    import re

    from tests.conftest import run_cli

    ok = run_cli("experiment=users", "audit.canaries=100", "max_steps=5", "tracking.enabled=false", "disable_tqdm=true",
                 f"output_dir={tmp_path / 'run'}", cwd=tmp_path, module=("-m", "workbench.audit"))
    assert ok.returncode == 0, ok.stderr[-3000:]
    found = re.search(r"audit: epsilon >= (\S+) per user \(.*100 canary users.*reported epsilon (\S+) per user",
                      ok.stdout)
    assert found, ok.stdout
    assert 0 <= float(found[1]) <= float(found[2]) <= 8.0


def _audit_on_rank(overrides):
    from workbench import compose, train

    r = train(compose(overrides))
    return r.epsilon, r.audit, r.sample_rate, r.noise_multiplier, r.delta, r.steps


@pytest.mark.slow
def test_two_ranks_with_shard_global_observe_the_same_updates_and_catch_a_weak_user_level_run(tmp_path):
    """W=2 over gloo, shard=global: each canary user's multiplicity per step is Binomial(2, q_r), which the white-box
    observer's likelihood ratio and the accountant both use; epsilon per user is dp_accounting's mixture of Gaussians
    for q_r = B / (W N_users) computed here, and the bound is caught below it."""
    from math import comb

    from workbench import launch_distributed

    overrides = [*_RUN, "per_device_train_batch_size=128", "ddp_shard=global", "backend=gloo", "max_steps=80",
                 "privacy.noise_multiplier=0.5", "privacy.target_epsilon=null", "tracking.enabled=false",
                 "disable_tqdm=true", f"output_dir={tmp_path / 'run'}"]
    ranks = launch_distributed(_audit_on_rank, 2, overrides)
    assert ranks[0] == ranks[1]  # every rank observed the same released updates
    epsilon, a, q, sigma, delta, steps = ranks[0]
    q_r = 256 / (2 * (_N_USERS + 1000))
    assert q == pytest.approx(q_r) and sigma == 0.5 and steps == 80 and a.unit == "user"
    probs = [comb(2, k) * q_r**k * (1 - q_r) ** (2 - k) for k in range(3)]
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=DEFAULT_PLD_DISCRETIZATION)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.dp_event.MixtureOfGaussiansDpEvent(0.5, [0, 1, 2], probs), 80))
    assert epsilon == pytest.approx(acc.get_epsilon(delta), rel=1e-6)
    assert 3 < a.epsilon_lower_bound <= epsilon, a


@pytest.mark.slow
@pytest.mark.parametrize("combined", [["privacy.mechanism=bandmf", "privacy.num_bands=2"], ["privacy.clipping=adaptive"]],
                         ids=["bandmf", "adaptive"])
def test_canary_users_audit_bandmf_and_adaptive_clipping_runs_below_their_epsilon_per_user(make_cfg, combined):
    """bandmf: each canary user's band is its user position's part (after the data's users), as the cyclic sampler
    over users draws it; adaptive: the canary user's mean gradient follows C_t. A weak run is caught by the white-box
    observer, the bound stays below the reported epsilon per user, and so does the simulated ideal."""
    from workbench import train

    result = train(make_cfg(*_RUN, "max_steps=40", "privacy.noise_multiplier=0.5", "privacy.target_epsilon=null",
                            "audit.canaries=500", "tracking=off", *combined))
    a = result.audit
    assert a.unit == "user" and a.canaries == 500
    assert 1 < a.epsilon_lower_bound <= result.epsilon and 0 < a.ideal_lower_bound <= result.epsilon, a


def test_canary_users_are_scored_in_the_part_the_cyclic_user_sampler_draws_them_from():
    """bandmf over users: the observer's band for canary user j is the part of its user position (after the data's
    users), which is the part the cyclic sampler over users draws it from, on every rank."""
    from types import SimpleNamespace

    from workbench.privacy.cyclic import banded_shard
    from workbench.privacy.users import UserCyclicSampler

    data = SyntheticUsers(num_users=50, size_scale=5, in_features=4, num_classes=3)
    m, world = 21, 2
    audit = CanaryAudit(m, data, 0.05)
    index = audit.users(index_users(data.users.tolist(), cap=2, seed=0))
    # bands such that a canary's slot index and its user position are in different parts: the test tells them apart
    b = next(b for b in (3, 4, 5, 7) if (len(data) - (len(index) - m)) % b)
    plan = SimpleNamespace(sample_rate=0.2, world_size=world, shard_mode="per_rank", gradient_noise_multiplier=1.0,
                           expected_batch=8, users=index, unit="user")
    observer = audit.start(secret=3, seed=0, clip=lambda: 1.0, mechanism=plan, coefficients=(1.0,) + (0.5,) * (b - 1))
    canary_positions = {len(index) - m + j: int(observer.bands[j]) for j in range(m)}
    seen = set()
    for rank in range(world):
        shard = banded_shard(user_shard(index, rank, world, "per_rank", 4), b, world)
        sampler = UserCyclicSampler(shard, b, 9, seed=0, rank=rank, index=index)
        for t in range(9):
            for position in sampler.part(t):
                if position in canary_positions:
                    assert canary_positions[position] == t % b, (rank, t, position)
                    seen.add(position)
    assert seen  # canary users are drawn from these parts at all (not all cut off by the shards)
