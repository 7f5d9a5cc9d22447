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


# --------------------------------------------------------------- BandMF and adaptive clipping (issues 22 and 23)


def _bandmf_audit(m, b, p, sigma, n=5):
    """A CanaryAudit started as job.py starts it for a bandmf run (one rank, in-band rate p): the real observer."""
    from types import SimpleNamespace

    from workbench.privacy.auditing.canaries import CanaryAudit
    from workbench.privacy.correlated import strategy

    base = [(torch.zeros(2), 0)] * n
    plan = SimpleNamespace(sample_rate=p, world_size=1, shard_mode="per_rank", expected_batch=1.0,
                           gradient_noise_multiplier=sigma)
    canaries = CanaryAudit(m, base, 0.05)
    c = strategy(b, 12)
    observer = canaries.start(secret=3, seed=0, clip=lambda: 1.0, mechanism=plan, coefficients=c)
    return canaries, observer, np.asarray(c)


def _released(c, steps, k, sigma, rng):
    """y = K + sigma C^{-1} Z, per canary (columns): BandMF's released coordinates, simulated directly."""
    b = len(c)
    strat = sum(np.diag(np.full(steps - j, c[j]), -j) for j in range(b) if j < steps)
    return k + sigma * np.linalg.solve(strat, rng.standard_normal((steps, k.shape[1]))), strat


def test_bandmf_white_box_score_is_the_exact_likelihood_ratio():
    """Against a brute-force oracle: the Gaussian likelihood of y under every participation pattern of the canary's
    part (covariance sigma^2 C^{-1} C^{-T}), summed with its Bernoulli(p) weights, over the non-member's."""
    from itertools import product

    from scipy.stats import multivariate_normal

    steps, b, p, sigma, m = 11, 3, 0.4, 0.9, 6
    canaries, observer, c = _bandmf_audit(m, b, p, sigma)
    rng = np.random.default_rng(0)
    bands = (canaries.dataset.n + np.arange(m)) % b
    k = np.zeros((steps, m))
    for j in range(m):
        k[bands[j]::b, j] = rng.random(len(range(bands[j], steps, b))) < p
    y, strat = _released(c, steps, k, sigma, rng)
    for t in range(steps):
        observer.observe(y[t])
    inv = np.linalg.inv(strat)
    cov = sigma**2 * inv @ inv.T
    for j in range(m):
        slots = list(range(bands[j], steps, b))
        member = 0.0
        for pattern in product((0, 1), repeat=len(slots)):
            mean = np.zeros(steps)
            mean[slots] = pattern
            weight = np.prod([p if x else 1 - p for x in pattern])
            member += weight * multivariate_normal(mean, cov).pdf(y[:, j])
        oracle = np.log(member / multivariate_normal(np.zeros(steps), cov).pdf(y[:, j]))
        assert observer.scores[j] == pytest.approx(oracle, rel=1e-6, abs=1e-9)


def test_bandmf_white_box_ratio_is_calibrated_on_non_members_and_members():
    """E[LR] = 1 for a non-member and E[1 / LR] = 1 for a member: what a likelihood ratio is. Scoring BandMF's
    correlated noise as if it were independent (the mutant bandmf-audit-ignores-correlation) breaks the first."""
    steps, b, p, sigma, m = 12, 3, 0.5, 1.5, 40_000
    rng = np.random.default_rng(1)
    for member in (False, True):
        canaries, observer, c = _bandmf_audit(m, b, p, sigma)
        bands = (canaries.dataset.n + np.arange(m)) % b
        k = np.zeros((steps, m))
        if member:
            for t in range(steps):
                k[t] = (bands == t % b) & (rng.random(m) < p)
        y, _ = _released(c, steps, k, sigma, rng)
        for t in range(steps):
            observer.observe(y[t])
        ratio = np.exp(-observer.scores if member else observer.scores)
        assert ratio.mean() == pytest.approx(1.0, abs=4 * ratio.std() / np.sqrt(m)), (member, ratio.mean())


def test_bandmf_audit_of_a_correct_run_stays_below_its_epsilon():
    """The simulated audit (the real observer on the mechanism simulated in numpy, each canary in its own part) at a
    noise whose accounted epsilon is about 2: the bound is far below it, and the ideal bound is of the same size."""
    from workbench.privacy.accounting.banded import BandMFAccountant

    steps, b, p, sigma, m = 40, 4, 0.5, 1.2, 1000
    canaries, observer, c = _bandmf_audit(m, b, p, sigma)
    members = canaries.members
    rng = np.random.default_rng(2)
    bands = (canaries.dataset.n + np.arange(m)) % b
    k = np.stack([(bands == t % b) & (rng.random(m) < p) & members for t in range(steps)]).astype(float)
    y, _ = _released(c, steps, k, sigma, rng)
    for t in range(steps):
        observer.observe(y[t])
    epsilon = BandMFAccountant("pld", p, sigma, b, 1, "per_rank").epsilon(steps, 1e-5)
    found = audit.audit({"white_box": observer.scores}, members, 1e-5, 0.05, epsilon)
    ideal = audit.ideal_lower_bound(m, p, sigma, steps, 1, "per_rank", 1e-5, observers=1, coefficients=tuple(c),
                                    bands=bands)
    assert found.epsilon_lower_bound < epsilon / 2 and ideal < epsilon / 2, (found, ideal, epsilon)
    assert found.epsilon_lower_bound > 0.2 and ideal > 0.2  # the observer sees the canaries: not a blind audit


def test_canary_slots_are_in_the_part_the_cyclic_sampler_draws_them_from():
    from workbench.privacy.cyclic import CyclicPoissonBatchSampler, banded_shard, part_of
    from workbench.privacy.sampling import train_shard

    for rank in (0, 1):
        shard = banded_shard(train_shard(103, rank, 2, "per_rank", 4), 3, 2)
        sampler = CyclicPoissonBatchSampler(shard, 3, 9, seed=0, rank=rank)
        for t in range(9):
            assert {part_of(i, 3) for i in sampler.part(t)} == {t % 3}


@pytest.mark.slow
def test_a_crashed_bandmf_audit_resumes_to_the_uninterrupted_audit_below_its_epsilon(make_cfg, tmp_path, monkeypatch,
                                                                                     mlflow_uri):
    """One bandmf audited run three ways (crashed, resumed, whole): the resumed audit is the uninterrupted one exactly
    (the observer's open blocks and past updates, the block and its optimizer state come back from the checkpoint);
    the bound is finite and below the reported epsilon; the audit's state stays out of the published checkpoint."""
    from mlflow import MlflowClient

    from workbench import checkpoint, train

    args = ["experiment=quick", "privacy.mechanism=bandmf", "privacy.num_bands=4", "save_steps=5", "audit=canaries",
            "audit.canaries=500", "data.train._target_=tests.plugins.FailingSynthetic", "privacy.secure_seed=77"]
    crashed = tmp_path / "crashed"
    monkeypatch.setenv("WB_FAIL_AT_FETCH", "13")
    with pytest.raises(RuntimeError, match="injected failure"):
        train(make_cfg(*args, f"output_dir={crashed}", "tracking.enabled=false"))
    monkeypatch.delenv("WB_FAIL_AT_FETCH")
    saved = checkpoint.load(checkpoint.list_checkpoints(crashed)[-1])
    assert 0 < saved["step"] < 20 and saved["audit"]["observer"]["step"] == saved["step"]
    resumed = train(make_cfg(*args, f"output_dir={crashed}", "resume_from_checkpoint=latest", "tracking.enabled=false"))
    whole = train(make_cfg(*args, f"output_dir={tmp_path / 'whole'}"))
    assert resumed.steps == whole.steps == 20 and resumed.audit == whole.audit
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), whole.model.parameters()))
    a = whole.audit
    assert math.isfinite(a.epsilon_lower_bound) and a.epsilon_lower_bound < whole.epsilon, (a, whole.epsilon)
    assert a.p_value_of_reported > 0.05 and math.isfinite(a.ideal_lower_bound) and a.ideal_lower_bound < whole.epsilon
    local = MlflowClient(tracking_uri=mlflow_uri).download_artifacts(whole.run_id, "checkpoints",
                                                                      str(tmp_path / "published"))
    assert "audit" not in checkpoint.load(next(Path(local).glob("*.pt")))
    assert "audit" in checkpoint.load(whole.checkpoint)


@pytest.mark.slow
def test_an_adaptive_clipping_audit_reads_each_step_at_its_own_clip_norm(make_cfg):
    """C moves every step; the canaries follow it and the observer reads step t in units of C_t / B at sigma_g: a
    leaky run (sigma 0.5) is caught as well as the simulated correct run's ideal, and the bound stays below epsilon."""
    from workbench import checkpoint, train

    result = train(make_cfg("audit=canaries", "data=synthetic", "data.train.size=1000", "max_steps=60",
                            "per_device_train_batch_size=64", "privacy.clipping=adaptive", "privacy.noise_multiplier=0.5",
                            "privacy.target_epsilon=null", "privacy.secure_seed=11", "tracking.enabled=false"))
    a = result.audit
    assert checkpoint.load(result.checkpoint)["clipping"]["clip_norm"] < 0.5  # C fell far from its start (1.0)
    assert a.ideal_lower_bound > 1 and a.epsilon_lower_bound > 1 and a.epsilon_lower_bound < result.epsilon, a


def test_a_blt_audit_runs_the_final_model_observer_alone_and_stays_below_its_epsilon(make_cfg):
    """blt: no white-box likelihood ratio is built for its noise, so the audit scores the final model alone (one
    observer in the Bonferroni family, no ideal bound) and still catches a leaky run, below its reported epsilon."""
    from workbench import train
    from workbench.privacy.auditing.bound import guess_counts

    result = train(make_cfg("audit=canaries", "audit.canaries=500", "data=synthetic", "data.train.size=1000",
                            "max_steps=40", "per_device_train_batch_size=64", "privacy.mechanism=blt",
                            "privacy.blt_buffers=2", "privacy.noise_multiplier=0.3", "privacy.target_epsilon=null",
                            "privacy.secure_seed=12", "tracking.enabled=false"))
    a = result.audit
    assert a.observer == "final_model" and a.tests == len(guess_counts(a.canaries)) and a.ideal_lower_bound is None
    assert 0.5 < a.epsilon_lower_bound < result.epsilon, (a, result.epsilon)
