"""User-level DP (privacy.unit=user; workbench/privacy/users.py, workbench/privacy/clipping/per_user.py,
workbench/user_step.py, workbench/data/users.py): per-user clipping against a per-user autograd oracle built here,
the floating-point bound per user, user sampling statistics, the cap, epsilon against dp_accounting with q_user, the
preset through the CLI, bit-exact resume, and the one-line refusals."""

import json
import math
import shutil
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from torch import nn

from tests.conftest import run_cli
from workbench.data.users import SyntheticUsers, user_ids
from workbench.distributed import setup
from workbench.errors import WorkbenchError
from workbench.privacy import DEFAULT_PLD_DISCRETIZATION
from workbench.privacy.clipping.bound import RHO
from workbench.privacy.users import UserPoissonSampler, index_users, user_shard
from workbench.user_step import UserGradientStep, pack

ALPHA = 1e-4


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _users_batch(sizes, seed=1, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    return torch.randn(n, 6, generator=g) * scale, torch.randint(0, 3, (n,), generator=g)


def _oracle(model, x, y, sizes, clip):
    """The definition, computed apart from the code under test: each example's own gradient by autograd on its loss
    alone (float64, a copy of the model), averaged per user, each user's mean clipped to C (flat L2 norm), summed."""
    import copy

    model = copy.deepcopy(model).double()
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    start, clipped = 0, 0
    for size in sizes:
        mean = [torch.zeros_like(p) for p in params]
        for i in range(start, start + size):
            loss = nn.functional.cross_entropy(model(x[i:i + 1].double()), y[i:i + 1])
            for m, g in zip(mean, torch.autograd.grad(loss, params)):
                m += g / size
        norm = float(torch.linalg.vector_norm(torch.cat([m.flatten() for m in mean])))
        clipped += norm > clip
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        for t, m in zip(total, mean):
            t += factor * m
        start += size
    return total, clipped


@pytest.mark.parametrize("mode", ["hooks", "ew", "vmap", "auto"])
@pytest.mark.parametrize("physical", [5, 64])
def test_per_user_clipping_matches_a_per_user_autograd_oracle(mode, physical):
    sizes = [3, 1, 5, 2, 4, 1, 5]
    x, y = _users_batch(sizes)
    clip = 1.5
    expected, clipped = _oracle(_model(), x, y, sizes, clip)
    assert 0 < clipped < len(sizes)  # the clip bites on some users, not all: both branches are compared
    step = UserGradientStep(_model(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=clip,
                            noise_multiplier=0.0, grad_sample_mode=mode, max_physical_batch_size=physical)
    assert step.mode != "bk"  # auto takes a mode that forms per-example gradients
    loss_sum, count = step(((x, y), sizes), step=0)
    assert count == len(y)
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-4, atol=1e-6)
    # the mean of per-example clipped gradients (example-level clipping) is a different number: not what is computed
    example_level, _ = _oracle(_model(), x, y, [1] * len(y), clip)
    assert not all(torch.allclose(p.grad.double(), e, rtol=1e-3) for p, e in zip(step.params, example_level))


def test_each_users_contribution_as_summed_is_within_the_floating_point_bound():
    """Huge inputs (norms ~1e6 C): each user alone through the real step adds a vector of norm <= C (1 + RHO)."""
    clip = 1.0
    sizes = [4, 1, 3]
    x, y = _users_batch(sizes, seed=5, scale=1e6)
    start = 0
    for size in sizes:
        step = UserGradientStep(_model(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=clip,
                                noise_multiplier=0.0, grad_sample_mode="hooks", max_physical_batch_size=8)
        step(((x[start:start + size], y[start:start + size]), [size]), step=0)
        norm = float(torch.linalg.vector_norm(step.update.double()))
        assert 0.5 * clip < norm <= clip * (1 + RHO)
        start += size


def test_bk_is_refused_in_one_line():
    with pytest.raises(WorkbenchError, match="grad_sample_mode=bk"):
        UserGradientStep(_model(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=1.0,
                         noise_multiplier=0.0, grad_sample_mode="bk")


def test_micro_batches_hold_whole_users():
    assert pack([3, 1, 5, 2, 4], 5) == [[3, 1], [5], [2], [4]]
    assert pack([], 5) == []
    with pytest.raises(WorkbenchError):
        pack([6], 5)


def test_the_cap_holds_and_is_a_fixed_choice_of_each_user_alone():
    rng = np.random.default_rng(0)
    user_of = rng.choice(["ann", "bob", "cy", "dee", "eve"], p=[0.5, 0.3, 0.1, 0.05, 0.05], size=300).tolist()
    index = index_users(user_of, cap=7, seed=11)
    for user, kept, size in zip(index.users, index.examples, index.sizes):
        own = [i for i, u in enumerate(user_of) if u == user]
        assert size == len(own) and len(kept) == min(7, len(own))
        assert set(kept) <= set(own) and kept == sorted(kept)
    assert index.dropped == sum(max(0, s - 7) for s in index.sizes) > 0
    assert index_users(user_of, 7, 11) == index  # fixed for the run: the same choice at every step and on resume
    # the choice of a user depends on that user alone: with another user removed, ann keeps the same examples
    without = [u if u != "bob" else None for u in user_of]
    kept = {u: e for u, e in zip(index.users, index.examples)}
    other = index_users([u for u in without if u is not None], 7, 11)
    position = [i for i, u in enumerate(without) if u is not None]
    again = {u: [position[i] for i in e] for u, e in zip(other.users, other.examples)}
    assert again["ann"] == kept["ann"] and again["cy"] == kept["cy"]
    assert "users" in index.describe() and f"drops {index.dropped} of 300" in index.describe()
    with pytest.raises(WorkbenchError, match="max_examples_per_user"):
        index_users(user_of, 0, 11)


def test_users_are_drawn_binomial_t_q_with_all_their_capped_examples():
    """Each user's inclusion count over T steps ~ Binomial(T, q_user), read from the example indices the sampler
    yields; a drawn user brings exactly its capped examples (all or none)."""
    from scipy import stats

    data = SyntheticUsers(num_users=150, seed=2)
    ids, _ = user_ids(data, "users")
    index = index_users(ids, cap=4, seed=0)
    shard = user_shard(index, 0, 1, "per_rank", 15)
    q = shard.sample_rate
    assert q == pytest.approx(15 / 150)
    user_at = {i: u for u, own in enumerate(index.examples) for i in own}
    steps = 1500
    counts = np.zeros(len(index), dtype=int)
    for step, batch in enumerate(UserPoissonSampler(shard, steps, seed=3, rank=0, index=index)):
        drawn = sorted({user_at[i] for i in batch})
        assert sorted(batch) == sorted(i for u in drawn for i in index.examples[u])  # all or none of a user's
        counts[drawn] += 1
    edges = np.unique(stats.binom.ppf(np.linspace(0, 1, 11)[1:-1], steps, q))
    expected = np.diff(np.concatenate([[0.0], stats.binom.cdf(edges, steps, q), [1.0]])) * len(counts)
    observed = np.bincount(np.searchsorted(edges, counts, side="left"), minlength=len(expected))
    assert stats.chisquare(observed, expected).pvalue > ALPHA
    dispersion = ((counts - steps * q) ** 2).sum() / (steps * q * (1 - q))  # ~ chi2(U): too even fails as well
    assert 2 * min(stats.chi2.cdf(dispersion, len(counts)), stats.chi2.sf(dispersion, len(counts))) > ALPHA
    sizes = [index.sizes[u] for u in range(len(index))]
    assert max(sizes) > 20 * np.median(sizes)  # users of very different sizes: big users are drawn no more often
    big = np.argsort(sizes)[-10:]
    assert abs(counts[big].mean() - steps * q) < 6 * math.sqrt(steps * q / 10)


def test_shard_modes_over_users():
    index = index_users(list(range(10)) * 2 + [10], cap=2, seed=0)  # 11 users
    a, b = (user_shard(index, r, 2, "per_rank", 2) for r in (0, 1))
    assert (a.indices, b.indices, a.population, a.dropped) == (range(0, 5), range(5, 10), 10, 1)
    g = user_shard(index, 1, 2, "global", 2)
    assert g.indices == range(11) and g.sample_rate == pytest.approx(4 / (2 * 11))
    with pytest.raises(WorkbenchError, match="users"):
        user_shard(index, 0, 1, "per_rank", 12)


def _direct_epsilon(q, sigma, steps, delta):
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=DEFAULT_PLD_DISCRETIZATION)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    return acc.get_epsilon(delta)


def test_the_preset_reports_epsilon_per_user_through_the_cli(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("experiment=users", "disable_tqdm=true", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = [line for line in proc.stdout.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and "per user" in done[0]
    assert any(line.startswith("privacy.unit=user: 1000 users, examples per user min 1") for line in proc.stdout.splitlines())
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    m, tags = run.data.metrics, run.data.tags
    assert tags["privacy_unit"] == "user" and run.info.status == "FINISHED"
    assert '"unit": "user"' in tags["workbench.dp_event"]
    n_users = len(SyntheticUsers(num_users=1000, seed=0).users.unique())
    assert m["sample_rate"] == pytest.approx(64 / n_users)  # q over users, not examples
    assert m["delta"] < 1 / n_users and m["epsilon"] <= 8.0
    assert m["epsilon"] == pytest.approx(_direct_epsilon(m["sample_rate"], m["noise_multiplier"], int(m["steps"]),
                                                         m["delta"]), rel=1e-6)
    assert m["eval_accuracy"] > 0.5
    # The training data's size in MLflow is its number of users: how many examples they hold is not public.
    (train_input,) = [d.dataset for d in run.inputs.dataset_inputs if d.tags[0].value == "training"]
    assert json.loads(train_input.profile) == {"num_users": n_users}


def test_a_resumed_user_level_run_ends_bit_exact(make_cfg):
    from workbench import checkpoint
    from workbench.run import train

    args = ["experiment=users", "tracking=off", "max_steps=12", "save_steps=4", "save_total_limit=10",
            "privacy.secure_seed=99", "privacy.max_examples_per_user=3", "max_physical_batch_size=16"]
    whole = train(make_cfg(*args))
    cfg = make_cfg(*args, "resume_from_checkpoint=latest")
    folder = checkpoint.list_checkpoints(whole.output_dir)
    assert [p.name for p in folder] == ["checkpoint-4.pt", "checkpoint-8.pt", "checkpoint-12.pt"]
    (tmp := Path(cfg.output_dir) / folder[1].parent.name).mkdir(parents=True)
    shutil.copy(folder[1], tmp / folder[1].name)  # resume from step 8
    resumed = train(cfg)
    a, b = checkpoint.load(folder[-1]), checkpoint.load(checkpoint.list_checkpoints(resumed.output_dir)[-1])
    assert a["step"] == b["step"] == 12
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["accountant"] == b["accountant"] and resumed.epsilon == whole.epsilon


@pytest.mark.parametrize("overrides, says", [
    (["data=synthetic", "privacy.unit=user"], "needs data.user_key"),
    (["experiment=users", "privacy.max_examples_per_user=0"], "privacy.max_examples_per_user must be >= 1"),
    (["experiment=users", "privacy.unit=person"], "privacy.unit='person' is unknown"),
    (["experiment=users", "privacy.grad_sample_mode=bk"], "does not support grad_sample_mode=bk"),
    (["experiment=users", "privacy=none", "privacy.unit=user"], "does not support privacy.enabled=false"),
    (["experiment=users", "max_physical_batch_size=4"], "more than max_physical_batch_size=4"),
    (["experiment=users", "data.user_key=nobody"], "data.user_key='nobody' is neither"),
])
def test_bad_user_level_settings_are_one_line_refusals_before_any_work(make_cfg, overrides, says):
    from workbench.run import train

    cfg = make_cfg("tracking=off", *overrides)
    with pytest.raises(WorkbenchError, match=says) as e:
        train(cfg)
    assert "\n" not in str(e.value)
    if "nobody" not in says:  # refused by the config check, before the run folder or any data exists
        assert not Path(cfg.output_dir).exists()


@pytest.mark.parametrize("missing", [None, float("nan"), torch.tensor(float("nan")), np.float64("nan")])
def test_an_example_without_a_user_id_is_refused_in_one_line(missing):
    """None would merge every example without an id into one user, NaN make each its own: neither is a person."""
    with pytest.raises(WorkbenchError, match="an example has no user id") as e:
        index_users([1, 2, missing, 2], cap=2, seed=0)
    assert "\n" not in str(e.value)


def test_mapping_examples_give_their_user_by_field_and_the_model_never_sees_it():
    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return {"x": torch.ones(2) * i, "labels": torch.tensor(i % 2), "author": f"u{i % 3}"}

    ids, seen = user_ids(Rows(), "author")
    assert ids == ["u0", "u1", "u2"] * 2 and "author" not in seen[0]
    index = index_users(ids, cap=1, seed=0)
    assert index.sizes == [2, 2, 2] and index.dropped == 3


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["per_rank", "global"])
def test_two_ranks_train_identically_and_account_over_users(tmp_path, mlflow_uri, shard):
    """W=2 over gloo: the parameters stay identical on both ranks, and epsilon is dp_accounting's for q over users
    (per_rank: B / N_users_used; global: parallel Poisson at B / (W N_users))."""
    from mlflow import MlflowClient

    from tests.test_distributed import _direct_epsilon, _train_on_rank
    from workbench import launch_distributed

    overrides = [f"output_dir={tmp_path}", f"tracking.uri={mlflow_uri}", "experiment=users", "disable_tqdm=true",
                 f"ddp_shard={shard}", "max_steps=10", "per_device_train_batch_size=32"]
    (p0, run0, eps0), (p1, run1, eps1) = launch_distributed(_train_on_rank, 2, overrides)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1)) and run0 == run1 and eps0 == eps1
    client = MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    m = run.data.metrics
    assert run.data.tags["privacy_unit"] == "user"
    n_users = 1000  # every one of SyntheticUsers' users has at least one example
    expected_q = 64 / n_users if shard == "per_rank" else 64 / (2 * n_users)
    assert m["sample_rate"] == pytest.approx(expected_q)
    assert eps0 == pytest.approx(_direct_epsilon(m, shard, 2), rel=1e-6)


class _Rows:
    """A stand-in for a materialising strategy: its backward leaves the given per-example rows in grad_sample."""

    mode, checked = "hooks", True

    def __init__(self, param, rows):
        self.params, self.rows, self.module = [param], rows, None

    def _backward(self, batch, loss_fn, checking=True):
        self.params[0].grad_sample = self.rows
        return torch.zeros(len(self.rows))


@pytest.mark.parametrize("rows, sizes", [
    (torch.tensor([[3e38, 3e38], [3e38, 3e38], [1.0, 0.0]]), [2, 1]),  # a user's float32 sum overflows
    (torch.tensor([[1e30, 1.0], [-1e30, 1.0], [2e-45, 0.0]]), [2, 1]),  # a user's examples cancel; a subnormal
    (torch.tensor([[float("inf"), 0.0], [1.0, 1.0]]), [1, 1]),  # not finite: that user contributes 0, the other C
])
def test_adversarial_users_stay_within_the_bound_and_a_finite_one_is_clipped_not_dropped(rows, sizes):
    from workbench.data.batches import Batch
    from workbench.privacy.clipping.per_user import PerUser

    param = nn.Parameter(torch.zeros(2))
    strategy = PerUser(_Rows(param, rows), clip=1.0)
    strategy.max_batch = 8
    start = 0
    for size in sizes:  # each user alone: its own contribution as added
        buffer = torch.zeros(2)
        strategy.inner.rows = rows[start:start + size]
        batch = Batch((), {}, torch.zeros(size))
        batch.user_sizes = [size]
        strategy.accumulate(batch, None, {id(param): buffer})
        mean = rows[start:start + size].double().mean(0)
        norm = float(torch.linalg.vector_norm(buffer.double()))
        assert norm <= 1.0 * (1 + RHO)
        if torch.isfinite(mean).all() and float(torch.linalg.vector_norm(mean)) >= 1.0:
            assert norm > 1.0 - 1e-5  # clipped to C, never dropped
        start += size


def test_a_sweep_plans_a_user_level_point_over_users():
    """What a sweep reads before any point trains (workbench.job.planned_mechanism): the event over users."""
    from workbench import compose
    from workbench.job import planned_mechanism

    fields = planned_mechanism(compose(["experiment=users", "tracking=off"]))
    assert fields["unit"] == "user" and fields["max_examples_per_user"] == 8
    assert fields["sample_rate"] == pytest.approx(64 / 1000) and fields["delta"] < 1 / 1000


@pytest.mark.slow
def test_a_sweep_over_the_unit_runs_and_warns_that_its_bound_mixes_units(tmp_path):
    import warnings

    from workbench import explore

    common = ["experiment=users", "max_steps=5", "disable_tqdm=true", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explore.sweep([["privacy.unit=user"], ["privacy.unit=example"]], common, sweep_dir=tmp_path / "sweep")
    messages = [str(w.message) for w in caught if str(w.message).startswith("sweep:")]
    assert any("protect different units" in m for m in messages), messages


def test_the_plots_say_epsilon_is_per_user():
    from workbench.plots import FIGURES

    fig = FIGURES["training_curves"](steps=[5, 10], loss=[1.0, 0.5], epsilon=[1.0, 2.0], delta=1e-5, unit="user")
    assert "epsilon per user" in fig.axes[0].get_ylabel()
    fig = FIGURES["privacy_tradeoff"]([0.001, 0.01, 1.0], [0.01, 0.05, 1.0], 2.0, 1e-5, 0.3, unit="user")
    assert "per user" in fig.axes[0].get_title() and "user inference" in fig.axes[0].get_title()
    fig = FIGURES["training_curves"](steps=[5], loss=[1.0], epsilon=[1.0], delta=1e-5)  # example level: as it was
    assert "per user" not in fig.axes[0].get_ylabel()


@pytest.mark.slow
@pytest.mark.parametrize("audited", [True], ids=["canary_users"])  # the plain run's checks are all made here too
def test_torchrun_two_processes_train_user_level_end_to_end(tmp_path, audited):
    """A real ``torchrun --standalone --nproc-per-node=2`` job of the preset (gloo, shard=per_rank): one FINISHED run,
    world_size 2, tagged privacy_unit=user, epsilon dp_accounting's for q_user = B / N_users computed here (with the
    audit, N_users counts its canary users: 1000 + 200, 600 per rank, so none is dropped, and the bound per user stays
    at or below epsilon per user)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    audit = ["audit=canaries", "audit.canaries=200"] if audited else []
    proc = run_cli("--standalone", "--nproc-per-node=2", "-m", "workbench", "experiment=users", "backend=gloo",
                   "ddp_shard=per_rank", "max_steps=10", "per_device_train_batch_size=32", "disable_tqdm=true", *audit,
                   cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri}, timeout=600, module=("-m", "torch.distributed.run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])  # one run, not per rank
    m, tags = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED" and m["world_size"] == 2 and tags["world_size"] == "2"
    assert tags["privacy_unit"] == "user" and tags["ddp_shard"] == "per_rank"
    assert tags["privacy_adjacency"] == "zero-out one user"  # per_rank on 2 ranks: the users' tail is cut by position
    n_users = len(SyntheticUsers(num_users=1000, seed=0).users.unique()) + (200 if audited else 0)
    q_user = 32 * 2 / n_users
    assert m["sample_rate"] == pytest.approx(q_user) and int(m["steps"]) == 10
    assert m["delta"] < 1 / n_users and 0 < m["epsilon"] <= 8.0
    assert m["epsilon"] == pytest.approx(_direct_epsilon(q_user, m["noise_multiplier"], 10, m["delta"]), rel=1e-6)
    done = [line for line in proc.stdout.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and "per user" in done[0]  # rank 0 alone closes the job
    if audited:
        assert m["audit_canaries"] == 200 and 0 <= m["audit_epsilon_lower_bound"] <= m["epsilon"]
        assert "audit: epsilon>=" in done[0] and done[0].count("per user") == 2
