"""The one-run audit's bound (workbench.audit) against direct binomial sums, and its guesses and scores."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench import audit


def _direct_p_value(m, r, v, eps, delta):
    """The theorem's right-hand side written out term by term: no scipy, no vectorisation."""
    q = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]
    beta = sum(pmf[v:])
    alpha = max((sum(pmf[v - i:v]) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, beta + 2 * m * delta * alpha)


@pytest.mark.parametrize("m,r,v,eps,delta", [
    (1000, 100, 90, 1.0, 0.0), (1000, 100, 90, 2.0, 1e-5), (1000, 200, 200, 3.0, 1e-5), (100, 50, 30, 0.5, 1e-3),
    (1000, 500, 260, 0.1, 1e-6), (10, 10, 7, 0.0, 0.01),
])
def test_p_value_matches_direct_binomial_sums(m, r, v, eps, delta):
    assert audit.p_value(m, r, v, eps, delta) == pytest.approx(_direct_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


def test_all_correct_without_delta_has_a_closed_form():
    # v = r: p = q^r, so the bound solves q = level^(1/r): eps = log(q / (1 - q)).
    r, level = 200, 0.05 / 16
    q = level ** (1 / r)
    assert audit.epsilon_lower_bound(1000, r, r, 0.0, level) == pytest.approx(math.log(q / (1 - q)), rel=1e-9)


@pytest.mark.parametrize("r,v,delta", [(200, 200, 1e-5), (100, 85, 1e-5), (500, 300, 1e-6)])
def test_bound_is_where_the_direct_p_value_crosses_the_level(r, v, delta):
    level = 0.05 / 16
    eps = audit.epsilon_lower_bound(1000, r, v, delta, level)
    assert eps > 0
    assert _direct_p_value(1000, r, v, eps, delta) <= level * (1 + 1e-9)  # float rounding at the crossing
    assert _direct_p_value(1000, r, v, eps + 1e-6, delta) > level


def test_delta_term_lowers_the_bound_and_chance_gives_none():
    assert audit.epsilon_lower_bound(1000, 200, 200, 1e-3, 0.05) < audit.epsilon_lower_bound(1000, 200, 200, 0.0, 0.05)
    assert audit.epsilon_lower_bound(1000, 100, 50, 1e-5, 0.05) == 0.0  # a coin's accuracy proves nothing


def test_correct_guesses_counts_top_members_and_bottom_non_members():
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    members = np.array([1, 0, 1, 0, 0, 1], dtype=bool)
    assert audit.correct_guesses(scores, members, 2, 0) == 1
    assert audit.correct_guesses(scores, members, 1, 2) == 1 + 1  # top: member; bottom two: one non-member
    assert audit.correct_guesses(scores, members, 3, 3) == 2 + 2


def test_bonferroni_family_and_p_value_of_the_reported_epsilon():
    rng = np.random.default_rng(1)
    members = rng.random(1000) < 0.5
    perfect = members.astype(float) + 0.01 * rng.random(1000)
    result = audit.audit({"white_box": perfect, "final_model": rng.random(1000)}, members, 1e-5, 0.05, 1.0)
    assert result.tests == 2 * len(audit.guess_counts(1000))
    level = 0.05 / result.tests
    assert result.observer == "white_box" and result.correct == result.guesses  # perfect scores: every guess right
    assert result.epsilon_lower_bound == pytest.approx(audit.epsilon_lower_bound(1000, result.guesses, result.correct,
                                                                                 1e-5, level))
    assert result.epsilon_lower_bound > 3
    # Perfect separation refutes epsilon = 1; the delta term (2 m delta alpha) keeps the p-value from vanishing.
    assert result.p_value_of_reported < 0.01
    assert audit.audit({"noise": rng.random(1000)}, members, 1e-5, 0.05, 1.0).p_value_of_reported > 0.05


def test_white_box_llr_is_the_mixture_likelihood_ratio():
    from scipy import stats

    x, sigma = np.array([-1.0, 0.3, 2.5]), 0.8
    probs = audit.multiplicity_probs(0.3, 2, "global")
    assert probs == pytest.approx([0.49, 0.42, 0.09])
    member = sum(p * stats.norm.pdf(x, k, sigma) for k, p in enumerate(probs))
    assert audit.white_box_llr(x, sigma, probs) == pytest.approx(np.log(member / stats.norm.pdf(x, 0, sigma)))
    assert list(audit.multiplicity_probs(0.3, 2, "per_rank")) == pytest.approx([0.7, 0.3])


def test_ideal_bound_grows_as_the_noise_falls():
    loud = audit.ideal_lower_bound(1000, 0.1, 5.0, 50, 1, "per_rank", 1e-5)
    quiet = audit.ideal_lower_bound(1000, 0.1, 0.5, 50, 1, "per_rank", 1e-5)
    assert loud < 1 < 3 < quiet


# --------------------------------------------------------------------------- real runs (slow: seconds each)

# 1000 examples + 1000 canary slots, expected batch 256: q = 0.128 per step.
_RUN = ["audit=canaries", "data=synthetic", "data.train.size=1000", "per_device_train_batch_size=256", "max_steps=80",
        "privacy.secure_seed=11"]
_LEAKY = {"none": ["privacy=none"], "sigma": ["privacy.noise_multiplier=0.5", "privacy.target_epsilon=null"]}
_EPS1 = ["privacy.target_epsilon=1"]


def _check_leaky(result):
    assert result.audit.epsilon_lower_bound > 3, result.audit
    assert result.audit.ideal_lower_bound > 3


def _check_eps1(result):
    assert result.epsilon == pytest.approx(1.0, abs=0.01)
    assert result.audit.epsilon_lower_bound < 1 and result.audit.p_value_of_reported > 0.05, result.audit


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(_LEAKY))
def test_a_leaky_run_is_caught(make_cfg, kind):
    from workbench import train

    _check_leaky(train(make_cfg(*_RUN, *_LEAKY[kind], "tracking.enabled=false")))


@pytest.mark.slow
def test_at_epsilon_one_the_reported_epsilon_stands_and_the_bound_is_in_mlflow(make_cfg, mlflow_uri, capsys):
    from mlflow import MlflowClient

    from workbench import train

    result = train(make_cfg(*_RUN, *_EPS1))
    _check_eps1(result)
    metrics = MlflowClient(tracking_uri=mlflow_uri).get_run(result.run_id).data.metrics
    a = result.audit
    assert metrics["audit_epsilon_lower_bound"] == pytest.approx(a.epsilon_lower_bound)
    assert (metrics["audit_correct"], metrics["audit_guesses"], metrics["audit_canaries"]) == (a.correct, a.guesses, 1000)
    assert metrics["audit_p_value_of_reported"] == pytest.approx(a.p_value_of_reported)
    assert metrics["audit_ideal_lower_bound"] == pytest.approx(a.ideal_lower_bound)
    assert metrics["delta"] == a.delta and metrics["epsilon"] == pytest.approx(result.epsilon)
    # The bound is recomputable from its logged inputs.
    assert a.epsilon_lower_bound == pytest.approx(audit.epsilon_lower_bound(
        1000, int(metrics["audit_guesses"]), int(metrics["audit_correct"]), metrics["delta"],
        metrics["audit_significance"] / metrics["audit_tests"]))
    assert f"audit: epsilon>={a.epsilon_lower_bound:.3f}" in capsys.readouterr().out


@pytest.mark.slow
def test_the_audited_model_and_published_checkpoint_look_unaudited(make_cfg, tmp_path, mlflow_uri):
    from mlflow import MlflowClient

    from workbench import train

    def published(result):
        client = MlflowClient(tracking_uri=mlflow_uri)
        folder = client.download_artifacts(result.run_id, "checkpoints", str(tmp_path / result.run_id))
        (path,) = list(Path(folder).glob("*.pt"))
        return torch.load(path, weights_only=True)

    audited = train(make_cfg("experiment=quick", "audit=canaries", "audit.canaries=50", f"output_dir={tmp_path / 'a'}"))
    plain = train(make_cfg("experiment=quick", f"output_dir={tmp_path / 'b'}"))
    shapes = lambda sd: {k: tuple(v.shape) for k, v in sd.items()}  # noqa: E731
    assert shapes(audited.model.state_dict()) == shapes(plain.model.state_dict())
    a, b = published(audited), published(plain)
    assert shapes(a["model"]) == shapes(b["model"]) and "secret" not in a
    assert a["optimizer"]["param_groups"][0]["params"] == b["optimizer"]["param_groups"][0]["params"]
    assert {k: shapes(v) for k, v in a["optimizer"]["state"].items()} == \
        {k: shapes(v) for k, v in b["optimizer"]["state"].items()}
    local = torch.load(audited.checkpoint, weights_only=True)  # the run folder's copy holds no block either
    assert shapes(local["model"]) == shapes(b["model"])


def _train_twice_on_rank(*runs):
    """Both runs in one process group (the workers join it as they would a torchrun group): half the start-ups."""
    import torch.distributed as dist

    from workbench import compose, train

    dist.init_process_group("gloo")
    try:
        return [(r.epsilon, r.audit) for r in (train(compose(overrides)) for overrides in runs)]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["per_rank", "global"])
def test_two_ranks_in_both_shard_modes(tmp_path, shard):
    from workbench import launch_distributed

    # Per-device batch 128 x 2 ranks: the same expected global batch of 256.
    base = [*_RUN, "per_device_train_batch_size=128", f"ddp_shard={shard}", "backend=gloo", "tracking.enabled=false",
            "disable_tqdm=true"]
    ranks = launch_distributed(_train_twice_on_rank, 2, [*base, *_LEAKY["sigma"], f"output_dir={tmp_path / 'leaky'}"],
                               [*base, *_EPS1, f"output_dir={tmp_path / 'eps1'}"])
    assert ranks[0] == ranks[1]  # every rank observed the same released updates
    (_, leaky), (epsilon, eps1) = ranks[0]
    assert leaky.epsilon_lower_bound > 3, leaky
    assert epsilon == pytest.approx(1.0, abs=0.01)
    assert eps1.epsilon_lower_bound < 1 and eps1.p_value_of_reported > 0.05, eps1


@pytest.mark.slow
def test_cli_prints_the_bound_and_refuses_bad_audit_settings(tmp_path):
    from tests.conftest import run_cli

    bad = run_cli("audit=canaries", "audit.canaries=0", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: audit.canaries must be >= 1")
    ok = run_cli("experiment=quick", "audit.canaries=100", "tracking.enabled=false", "disable_tqdm=true",
                 f"output_dir={tmp_path / 'run'}", cwd=tmp_path, module=("-m", "workbench.audit"))
    assert ok.returncode == 0, ok.stderr
    assert "audit: epsilon >= " in ok.stdout and "100 canaries" in ok.stdout
