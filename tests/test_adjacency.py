"""Which neighbouring datasets each mechanism's epsilon is about (Mechanism.adjacency, the ``privacy_adjacency`` MLflow
tag): checked from what the samplers draw, against dp-accounting under both relations, and in real SQLite runs."""

import functools
import json

import dp_accounting
import pytest
from dp_accounting import NeighboringRelation as Rel
from mlflow import MlflowClient

from workbench import compose, run
from workbench.privacy import Accountant
from workbench.privacy.mechanism import plan
from workbench.privacy.sampling import train_shard

ADD_OR_REMOVE, ZERO_OUT = "add-or-remove one example", "zero-out one example"


@functools.lru_cache
def _privacy(kind: str):
    return compose([f"privacy.mechanism={kind}", "privacy.num_bands=2", "privacy.blt_buffers=1",
                    "privacy.noise_multiplier=1.0", "privacy.target_epsilon=null"]).privacy


def _roles(kind: str, mode: str, world: int, n: int, gone: int | None = None):
    """What each example (by identity: its index in the full set of n) may do in a run over the set without example
    `gone`: on which ranks it can be drawn, and for bandmf in which cyclic part (q = B / N is taken as public, as the
    accounting takes it); blt's fixed batches are of public size (no role of its own)."""
    identity = [i for i in range(n) if i != gone]
    p = _privacy(kind)
    roles = {}
    for rank in range(world):
        m = plan(p, train_shard(len(identity), rank, world, mode, 2), mode, world, 4)
        for index in m.shard.indices:
            roles.setdefault(identity[index], set()).add((rank, index % m.num_bands if kind == "bandmf" else None))
    return m.adjacency, {k: frozenset(v) for k, v in roles.items()}


@pytest.mark.parametrize("kind,mode,world", [("dpsgd", "per_rank", 1), ("dpsgd", "global", 2), ("dpsgd", "global", 1),
                                             ("dpsgd", "per_rank", 2), ("bandmf", "per_rank", 1),
                                             ("bandmf", "per_rank", 2), ("blt", "per_rank", 1)])
def test_add_or_remove_is_claimed_exactly_where_removing_an_example_leaves_the_others_as_they_were(kind, mode, world):
    """Add-or-remove holds when, for every example removed, every other example keeps its role (drawn or not, where,
    which part) and nothing else changes; where some removal moves another example (a tail cut by index, a part by index,
    a batch of fixed size), the claim must be zero-out."""
    n = 12
    claimed, full = _roles(kind, mode, world, n)
    kept = all(_roles(kind, mode, world, n, gone)[1] == {k: v for k, v in full.items() if k != gone}
               for gone in range(n))
    fixed_batches = kind == "blt"  # every step takes exactly B / W per rank, whatever N: no one is simply absent
    assert claimed == (ADD_OR_REMOVE if kept and not fixed_batches else ZERO_OUT)
    assert claimed == (ADD_OR_REMOVE if kind == "dpsgd" and (mode == "global" or world == 1) else ZERO_OUT)


def _epsilon(relation, event, delta=1e-5):
    acc = dp_accounting.pld.PLDAccountant(relation, value_discretization_interval=1e-3)
    return acc.compose(event).get_epsilon(delta)


def test_dp_accounting_gives_the_same_epsilon_under_add_or_remove_and_zero_out():
    """The events the accountants build (Poisson-subsampled Gaussian, parallel-Poisson mixture, blt's plain Gaussian)
    have the same PLD and RDP epsilon under ADD_OR_REMOVE_ONE and REPLACE_SPECIAL (zero-out), and ours equals them;
    replace-one, a relation no mechanism here claims, would cost more."""
    q, sigma, steps = 0.02, 1.1, 100
    poisson = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    ours = Accountant("pld", q, sigma, pld_discretization=1e-3).epsilon(steps, 1e-5)
    assert _epsilon(Rel.ADD_OR_REMOVE_ONE, poisson) == _epsilon(Rel.REPLACE_SPECIAL, poisson)
    assert ours == pytest.approx(_epsilon(Rel.REPLACE_SPECIAL, poisson), rel=1e-9)
    rdp = [dp_accounting.rdp.RdpAccountant(neighboring_relation=r).compose(poisson).get_epsilon(1e-5)
           for r in (Rel.ADD_OR_REMOVE_ONE, Rel.REPLACE_SPECIAL)]
    assert rdp[0] == rdp[1] == pytest.approx(Accountant("rdp", q, sigma).epsilon(steps, 1e-5), rel=1e-12)

    mixture = Accountant("pld", q / 2, sigma, world_size=2, shard="global", pld_discretization=1e-3)  # shard=global's parallel Poisson
    event = mixture.event(50)
    assert _epsilon(Rel.ADD_OR_REMOVE_ONE, event) == _epsilon(Rel.REPLACE_SPECIAL, event)
    assert mixture.epsilon(50, 1e-5) == pytest.approx(_epsilon(Rel.REPLACE_SPECIAL, event), rel=1e-3)

    gaussian = dp_accounting.GaussianDpEvent(4.0)  # blt's event, sigma / sens(t)
    same = [_epsilon(r, gaussian) for r in (Rel.ADD_OR_REMOVE_ONE, Rel.REPLACE_SPECIAL)]
    assert same[0] == same[1] < _epsilon(Rel.REPLACE_ONE, gaussian)


QUICK = ("experiment=quick", "max_steps=2", "data.eval=null")


@pytest.mark.parametrize("overrides,expected", [
    ((), ADD_OR_REMOVE),
    (("privacy.mechanism=bandmf", "privacy.num_bands=2"), ZERO_OUT),
    (("privacy.mechanism=blt", "privacy.blt_buffers=1"), ZERO_OUT),
    (("experiment=users", "max_steps=2", "data.eval=null"), "add-or-remove one user"),
    (("experiment=users", "max_steps=2", "data.eval=null", "privacy.mechanism=bandmf", "privacy.num_bands=2"),
     "zero-out one user"),
    (("privacy=none",), None),
], ids=["dpsgd", "bandmf", "blt", "users", "users-bandmf", "not-private"])
def test_every_private_run_publishes_its_adjacency_in_mlflow(make_cfg, mlflow_uri, overrides, expected):
    """A real run on a real SQLite store: the tag (and the dp_event's field the sweep reads) is the mechanism's."""
    run.train(make_cfg(*QUICK, *overrides))
    (logged,) = MlflowClient(mlflow_uri).search_runs(
        [MlflowClient(mlflow_uri).get_experiment_by_name("workbench").experiment_id])
    assert logged.info.status == "FINISHED"
    assert logged.data.tags.get("privacy_adjacency") == expected
    if expected is not None:
        assert json.loads(logged.data.tags["workbench.dp_event"])["adjacency"] == expected
