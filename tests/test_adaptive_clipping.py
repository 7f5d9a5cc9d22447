"""Adaptive clipping (workbench/privacy/clipping/adaptive.py; Andrew et al., NeurIPS 2021): the geometric update against
a hand computation, the two noises against their formula, epsilon against dp-accounting at the stated sigma, the count
against the per-example oracle in every mode (and the clipped sum at C_t), convergence to a known quantile, W=2 over
gloo, a bit-exact resume, and the refusals."""

import math

import dp_accounting
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from tests.conftest import run_cli
from tests.oracle import CLIPPED_RTOL, clipped_sum, rows
from workbench import checkpoint
from workbench.distributed import setup
from workbench.errors import WorkbenchError
from workbench.privacy import DEFAULT_PLD_DISCRETIZATION
from workbench.privacy.clipping.adaptive import (AdaptiveClip, FixedClip, composed_noise_multiplier,
                                                 default_count_noise, gradient_noise_multiplier)
from workbench.privacy.mechanism import plan
from workbench.privacy.sampling import train_shard
from workbench.step import GradientStep


def _privacy(**overrides):
    base = dict(enabled=True, accountant="pld", target_epsilon=None, target_delta=1e-5, noise_multiplier=1.1,
                max_grad_norm=1.0, clipping="adaptive", target_quantile=0.5, clip_learning_rate=0.2,
                clip_count_noise=None)
    return OmegaConf.create({**base, **overrides})


# ------------------------------------------------------------------------------------------ the rule and its noise


def test_update_rule_matches_a_hand_computation():
    clip = AdaptiveClip(2.0, target_quantile=0.7, learning_rate=0.3, count_noise=1.0, expected_batch=40)
    c = 2.0
    for released in [-20.0, 3.5, 12.25, 0.0, -7.0]:  # S = sum(b_i - 1/2) + noise, as the all-reduce releases it
        clip.update(released)
        b = (released + 40 / 2) / 40  # the unclipped fraction: (S + B/2) / B
        c = c * math.exp(-0.3 * (b - 0.7))
        assert clip.fraction == pytest.approx(b, abs=1e-15)
        assert clip.value == pytest.approx(c, rel=1e-14)
    # all clipped (b = 0): C grows by exp(eta gamma); none clipped (b = 1): it shrinks by exp(-eta (1 - gamma))
    up, down = AdaptiveClip(1.0, 0.5, 0.2, 0.0, 10), AdaptiveClip(1.0, 0.5, 0.2, 0.0, 10)
    up.update(-5.0)
    down.update(5.0)
    assert up.value == pytest.approx(math.exp(0.1)) and down.value == pytest.approx(math.exp(-0.1))
    assert default_count_noise(256) == pytest.approx(12.8)  # the paper's sigma_b = m / 20


def test_gradient_noise_is_raised_so_that_the_two_compose_to_sigma():
    for sigma, sigma_b in [(1.0, 5.0), (0.6, 12.8), (3.0, 1.6)]:
        g = gradient_noise_multiplier(sigma, sigma_b)
        assert g == pytest.approx((sigma ** -2 - (2 * sigma_b) ** -2) ** -0.5, rel=1e-15) and g > sigma
        assert composed_noise_multiplier(g, sigma_b) == pytest.approx(sigma, rel=1e-12)
    assert gradient_noise_multiplier(1.0, 5.0) == pytest.approx(1.0050378152592121, rel=1e-15)  # (1 - 1/100)^-1/2
    with pytest.raises(WorkbenchError, match=r"clip_count_noise=0.5 is too small for noise_multiplier=1.*above 0.5"):
        gradient_noise_multiplier(1.0, 0.5)  # 2 sigma_b = sigma: the count alone would spend everything
    assert FixedClip(0.7).gradient_noise(1.3) == 1.3


def test_theorem_1_against_dp_accounting_composition():
    """Without subsampling, the gradient at sigma_g and the count (sensitivity 1/2) at sigma_b, composed by dp-accounting
    as two Gaussian mechanisms, spend what one Gaussian at sigma spends."""
    sigma, sigma_b = 0.9, 1.0
    g = gradient_noise_multiplier(sigma, sigma_b)

    def eps(*events):
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        for e in events:
            acc.compose(e)
        return acc.get_epsilon(1e-5)

    both = eps(dp_accounting.GaussianDpEvent(g), dp_accounting.GaussianDpEvent(2 * sigma_b))
    assert both == pytest.approx(eps(dp_accounting.GaussianDpEvent(sigma)), rel=2e-3)


def _noise_steps(steps, sigma_g, sigma_b, clip0=0.7, lr=0.05, batch=30):
    d = setup("gloo")
    schedule = AdaptiveClip(clip0, 0.5, lr, sigma_b, batch)
    step = GradientStep(nn.Linear(100, 50), nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=clip0,
                        noise_multiplier=sigma_g, clip_schedule=schedule, noise_seed=1234)
    grads, counts = [], []
    for s in range(steps):
        c = schedule.value
        step(None, step=s)  # an empty Poisson batch: both slots are pure noise
        grads.append(torch.cat([p.grad.flatten() for p in step.params]) / c)
        counts.append((schedule.fraction - 0.5) * batch)  # S back from b_t = S / B + 1/2
    return step, schedule, torch.stack(grads), np.array(counts)


def test_gradient_noise_std_is_sigma_g_times_c_t_and_count_noise_std_is_sigma_b():
    sigma, sigma_b = 1.2, 4.0
    sigma_g = gradient_noise_multiplier(sigma, sigma_b)
    step, schedule, grads, counts = _noise_steps(400, sigma_g, sigma_b)
    assert float(grads.std()) == pytest.approx(sigma_g, rel=0.01)  # 2 million draws, each scaled by its own C_t
    assert abs(float(grads.mean())) < 0.01
    assert float(np.std(counts)) == pytest.approx(sigma_b, rel=0.1)  # 400 draws: std's error ~3.5 %
    assert abs(float(np.mean(counts))) < 4 * sigma_b / math.sqrt(400)
    assert abs(np.corrcoef(counts[1:], grads[1:, 0].numpy())[0, 1]) < 0.2  # separate streams
    # a step draws its own noise again (a resumed run replays it), C_t included
    schedule.value = 0.7
    step(None, step=3)
    again = (schedule.fraction - 0.5) * 30
    assert again == pytest.approx(counts[3], abs=1e-5)


def test_noise_is_only_on_rank_0():
    d = setup("gloo")
    d.rank = 1  # what a non-zero rank's step adds: neither noise
    schedule = AdaptiveClip(1.0, 0.5, 0.2, 5.0, 10)
    step = GradientStep(nn.Linear(4, 2), nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=1.0,
                        noise_multiplier=2.0, clip_schedule=schedule)
    step(None, step=0)
    assert schedule.fraction == 0.5 and all(float(p.grad.abs().sum()) == 0 for p in step.params)


# ------------------------------------------------------------------------------------------------------ accounting


def _direct_epsilon(q, sigma, steps, delta):
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=DEFAULT_PLD_DISCRETIZATION)
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    return acc.get_epsilon(delta)


def test_epsilon_equals_the_fixed_c_run_at_the_stated_sigma():
    shard = train_shard(6000, 0, 1, "per_rank", 120)
    adaptive = plan(_privacy(), shard, "per_rank", 1, 200)
    fixed = plan(_privacy(clipping="fixed"), shard, "per_rank", 1, 200)
    assert adaptive.noise_multiplier == fixed.noise_multiplier == 1.1  # the accounted sigma, as stated
    assert adaptive.gradient_noise_multiplier == pytest.approx(gradient_noise_multiplier(1.1, 120 / 20))
    assert fixed.gradient_noise_multiplier == 1.1
    eps = adaptive.epsilon(200)
    assert eps == fixed.epsilon(200)
    assert eps == pytest.approx(_direct_epsilon(120 / 6000, 1.1, 200, 1e-5), rel=1e-6)
    assert adaptive.event_fields()["noise_multiplier"] == 1.1 and adaptive.event_fields()["clipping"] == "adaptive"
    # calibrated to a target: the same sigma as the fixed-C run; only the gradient's share is raised
    a = plan(_privacy(noise_multiplier=None, target_epsilon=3.0), shard, "per_rank", 1, 200)
    f = plan(_privacy(noise_multiplier=None, target_epsilon=3.0, clipping="fixed"), shard, "per_rank", 1, 200)
    assert a.noise_multiplier == f.noise_multiplier and a.epsilon(200) == f.epsilon(200) <= 3.0
    assert a.gradient_noise_multiplier > a.noise_multiplier


def test_a_count_noise_too_small_for_sigma_is_refused_by_the_plan():
    shard = train_shard(6000, 0, 1, "per_rank", 120)
    with pytest.raises(WorkbenchError, match="too small for noise_multiplier=1.1"):
        plan(_privacy(clip_count_noise=0.5), shard, "per_rank", 1, 200)


# -------------------------------------------------------------------------- the count, in every mode, and C_t's sum


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _norms(model, x, y):
    out = []
    for example in rows(x, y):
        g = clipped_sum(model, [example], 1e30).grads
        out.append(float(torch.cat([t.flatten() for t in g]).norm()))
    return sorted(out)


@pytest.mark.parametrize("mode", ["bk", "hooks", "functorch", "ew", "vmap"])
@pytest.mark.parametrize("physical", [4, 64])
def test_the_count_is_the_examples_within_c_t_and_the_sum_is_clipped_at_c_t(mode, physical):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(13, 6, generator=g) * 3, torch.randint(0, 3, (13,), generator=g)
    norms = _norms(_model(), x, y)
    c0 = (norms[3] + norms[4]) / 2  # 4 examples within C_0: no norm near the bound
    schedule = AdaptiveClip(c0, 0.5, 0.5, 0.0, expected_batch=13)  # no count noise: the count itself is released
    model = _model()
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=c0,
                        noise_multiplier=0.0, grad_sample_mode=mode, max_physical_batch_size=physical,
                        clip_schedule=schedule)
    _, count = step((x, y), step=0)
    assert count == 13 and step.flat[-1].item() == 4 - 13 / 2  # the shifted count, released as it is here
    assert schedule.fraction == pytest.approx(4 / 13)
    c1 = schedule.value
    assert c1 == pytest.approx(c0 * math.exp(-0.5 * (4 / 13 - 0.5)))
    assert not any(abs(n / c1 - 1) < 1e-3 for n in norms)
    # the next step clips at C_1 (the floating-point bound at C_t): the oracle's sum at C_1, same parameters
    expected, clipped = clipped_sum(_model(), rows(x, y), c1)  # a fresh copy: Opacus hooks the stepped one
    step((x, y), step=1)
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-6)
    assert clipped > 0 and step.flat[-1].item() == (13 - clipped) - 13 / 2


# --------------------------------------------------------------------------------------------------- convergence


class _Linear(nn.Module):
    """loss_i = w a_i: example i's gradient is a_i whatever w, so the per-example norms are |a_i|, drawn here."""

    def forward(self, logits, labels):
        return logits.squeeze(-1)


@pytest.mark.parametrize("quantile, start", [(0.5, 10.0), (0.5, 0.01), (0.9, 0.1)])
def test_c_converges_to_the_target_quantile_of_the_norms(quantile, start):
    batch, steps = 200, 300
    model = nn.Linear(1, 1, bias=False)
    schedule = AdaptiveClip(start, quantile, 0.2, 1.0, expected_batch=batch)
    step = GradientStep(model, _Linear(), setup("gloo"), max_grad_norm=start, noise_multiplier=0.0,
                        grad_sample_mode="bk", clip_schedule=schedule, noise_seed=7)
    g = torch.Generator().manual_seed(3)
    path = []
    for s in range(steps):
        a = torch.randn(batch, 1, generator=g).abs()  # |N(0, 1)|: its quantile q is Phi^-1((1 + q) / 2)
        step((a, torch.zeros(batch, dtype=torch.long)), step=s)
        path.append(schedule.value)
    from statistics import NormalDist

    truth = NormalDist().inv_cdf((1 + quantile) / 2)  # 0.674 for the median, 1.645 for 0.9
    assert float(np.exp(np.mean(np.log(path[-100:])))) == pytest.approx(truth, rel=0.05)


# ------------------------------------------------------------------------------------------------ W=2, resume, CLI


def _adaptive_on_rank(parts, steps):
    from workbench.distributed import teardown

    d = setup("gloo")
    calls = []
    reduce = d.all_reduce_
    d.all_reduce_ = lambda t: (calls.append(t.numel()), reduce(t))[1]
    try:
        sigma_b = 3.0
        schedule = AdaptiveClip(0.5, 0.5, 0.2, sigma_b, expected_batch=24)
        step = GradientStep(_model(), nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=0.5,
                            noise_multiplier=gradient_noise_multiplier(1.0, sigma_b), max_physical_batch_size=5,
                            clip_schedule=schedule, noise_seed=99)
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(24, 6, generator=g) * 3, torch.randint(0, 3, (24,), generator=g)
        path = []
        for s in range(steps):
            lo, hi = parts[d.rank]
            step((x[lo:hi], y[lo:hi]), s)
            path.append(schedule.value)
        return path, calls
    finally:
        teardown(d)


@pytest.mark.slow
def test_w2_gloo_c_is_identical_on_both_ranks_with_one_collective_per_step():
    from workbench import launch_distributed

    (path0, calls0), (path1, calls1) = launch_distributed(_adaptive_on_rank, 2, [(0, 10), (10, 24)], 6)
    assert path0 == path1 and len(set(path0)) == 6  # identical, bit for bit, and moving
    assert len(calls0) == len(calls1) == 6  # one all-reduce per step, the count in it
    single, _ = _adaptive_on_rank([(0, 24)], 6)  # the same noise from rank 0: the one-process path, up to rounding
    assert single == pytest.approx(path0, rel=1e-5)


def _train_on_rank(overrides):
    from workbench import compose, train

    result = train(compose(overrides))
    return [p.detach().clone() for p in result.model.parameters()], result.epsilon, result.metrics


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["per_rank", "global"])
def test_w2_runs_end_to_end_in_both_shard_modes(tmp_path, mlflow_uri, shard):
    from mlflow import MlflowClient

    from workbench import launch_distributed

    base = [f"tracking.uri={mlflow_uri}", "experiment=quick", "disable_tqdm=true", f"shard={shard}",
            "max_steps=10", "privacy.noise_multiplier=1.0", "privacy.target_epsilon=null", "privacy.secure_seed=5"]
    (p0, eps0, _), (p1, eps1, _) = launch_distributed(
        _train_on_rank, 2, [*base, f"output_dir={tmp_path / 'a'}", "privacy.clipping=adaptive",
                            "privacy.max_grad_norm=0.05"])
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    fixed = launch_distributed(_train_on_rank, 2, [*base, f"output_dir={tmp_path / 'f'}"])
    assert eps0 == eps1 == fixed[0][1]  # the same epsilon as fixed C at the stated sigma
    client = MlflowClient(tracking_uri=mlflow_uri)
    run = next(r for r in client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
               if r.data.params["output_dir"] == str(tmp_path / "a"))
    clip_norms = client.get_metric_history(run.info.run_id, "clip_norm")
    assert [m.step for m in clip_norms] == [5, 10] and clip_norms[-1].value != 0.05
    assert run.data.metrics["gradient_noise_multiplier"] > run.data.metrics["noise_multiplier"] == 1.0


RESUME_ARGS = ["experiment=quick", "data.train._target_=tests.plugins.DyingSynthetic", "max_steps=20", "save_steps=5",
               "save_total_limit=2", "disable_tqdm=true", "privacy.secure_seed=1234", "privacy.clipping=adaptive",
               "privacy.max_grad_norm=0.05"]


@pytest.mark.slow
def test_a_killed_adaptive_run_resumes_bit_exactly(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri}
    whole = run_cli(*RESUME_ARGS, f"output_dir={tmp_path / 'whole'}", cwd=tmp_path, env=env)
    assert whole.returncode == 0, whole.stderr[-2000:]
    crashed = run_cli(*RESUME_ARGS, f"output_dir={tmp_path / 'crashed'}", cwd=tmp_path,
                      env={**env, "WB_KILL_AT_FETCH": "13"})
    assert crashed.returncode == -9
    resumed = run_cli(*RESUME_ARGS, f"output_dir={tmp_path / 'crashed'}", "resume_from_checkpoint=latest",
                      cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = (checkpoint.load(checkpoint.list_checkpoints(tmp_path / run)[-1]) for run in ("whole", "crashed"))
    assert a["step"] == b["step"] == 20
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["clipping"] == b["clipping"] and a["clipping"]["clip_norm"] != 0.05
    client = MlflowClient(tracking_uri=uri)
    runs = {r.data.params["output_dir"]: r for r in client.search_runs([client.get_experiment_by_name("workbench").experiment_id])}
    history = {k: [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, "clip_norm")] for k, r in runs.items()}
    assert sorted(history[str(tmp_path / "whole")]) == sorted(history[str(tmp_path / "crashed")])
    assert [s for s, _ in sorted(history[str(tmp_path / "whole")])] == [5, 10, 15, 20]
    assert runs[str(tmp_path / "whole")].data.metrics["clip_norm"] == a["clipping"]["clip_norm"]


def test_a_run_logs_c_on_every_line_and_in_its_summary(make_cfg, mlflow_uri):
    from mlflow import MlflowClient

    from workbench import train

    result = train(make_cfg("experiment=quick", "max_steps=10", "privacy.clipping=adaptive", "privacy.max_grad_norm=20",
                            "tracking.log_model=false"))
    client = MlflowClient(tracking_uri=mlflow_uri)
    history = client.get_metric_history(result.run_id, "clip_norm")
    assert [m.step for m in history] == [5, 10]
    # C far too large: every example unclipped (b ~ 1, up to the batch's and the count's noise), C shrinks by ~e^-0.1 a step
    assert 20 > history[0].value > history[1].value and history[1].value < 20 * math.exp(-0.5)
    assert client.get_run(result.run_id).data.metrics["clip_norm"] == history[-1].value


# --------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, message", [
    (["privacy.target_quantile=0"], "privacy.target_quantile must be in (0, 1), got 0"),
    (["privacy.target_quantile=1.2"], "privacy.target_quantile must be in (0, 1), got 1.2"),
    (["privacy.clip_learning_rate=-0.2"], "privacy.clip_learning_rate must be > 0, got -0.2"),
    (["privacy.clip_count_noise=-1"], "privacy.clip_count_noise must be > 0, got -1"),
    (["privacy.clip_count_noise=0"], "privacy.clip_count_noise must be > 0, got 0"),
    (["privacy.clipping=median"], "privacy.clipping='median' is unknown; choose one of fixed, adaptive"),
    (["privacy.clipping=adaptive", "privacy.clip_count_noise=0.1", "privacy.noise_multiplier=1.0",
      "privacy.target_epsilon=null"], "privacy.clip_count_noise=0.1 is too small for noise_multiplier=1"),
])
def test_bad_adaptive_input_is_refused_in_one_line(tmp_path, args, message):
    from workbench.__main__ import check_args, launch_or_clean_up

    setup_args = [f"output_dir={tmp_path / 'run'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
                  "disable_tqdm=true", "experiment=quick"]
    with pytest.raises(WorkbenchError) as err:
        for cfg in check_args([*setup_args, *args]):
            launch_or_clean_up(cfg)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run").exists()
