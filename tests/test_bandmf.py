"""Correlated noise by banded matrix factorization (privacy.mechanism=bandmf, issue 22): the strategy, the noise's
covariance and memory, cyclic Poisson participation, the amplified-BandMF epsilon against dp_accounting built here
and against jax_privacy 2.0.0 (a separate venv, `make oracle`'s .venv-oracle, built by `make test`), the refusals,
a whole run, resume."""

import json
import math
import os
import subprocess
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import PLDAccountant

from tests.conftest import REPO
from workbench import checkpoint, privacy
from workbench.errors import WorkbenchError
from workbench.privacy.accounting.banded import BandMFAccountant, accountant_of, participations
from workbench.privacy.correlated import BandedNoise, prefix_sum_error, sqrt_coefficients, strategy
from workbench.privacy.cyclic import CyclicPoissonBatchSampler, banded_shard
from workbench.privacy.noise import GaussianNoise
from workbench.privacy.sampling import PoissonBatchSampler, train_shard
from workbench.privacy.accounting.accountant import LINE_SLACK

DELTA = 1e-5


def _toeplitz(c, n):
    m = np.zeros((n, n))
    for j, v in enumerate(c):
        m += np.diag(np.full(n - j, v), -j)
    return m


def direct_bandmf_epsilon(p, sigma, steps, b, delta=DELTA, d=privacy.DEFAULT_PLD_DISCRETIZATION):
    """Amplified BandMF built here from dp_accounting: Poisson(p) Gaussian(sigma) composed ceil(T / b) times."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(sigma)), math.ceil(steps / b))
    return PLDAccountant(value_discretization_interval=d).compose(event).get_epsilon(delta)


# --- the strategy -----------------------------------------------------------------------------------------------

def test_the_strategy_starts_from_the_square_root_and_beats_it_at_unit_norm():
    assert np.allclose(sqrt_coefficients(5), [1, 1 / 2, 3 / 8, 5 / 16, 35 / 128])
    # the binomial series is the square root of the prefix-sum matrix: (its Toeplitz)^2 = A
    s = _toeplitz(sqrt_coefficients(8), 8)
    assert np.allclose(s @ s, np.tril(np.ones((8, 8))))
    for b, steps in [(1, 50), (2, 50), (4, 300), (8, 1000), (4, 2), (8, 3)]:  # fewer steps than bands too
        c = np.array(strategy(b, steps))
        assert len(c) == b and c[0] > 0 and np.linalg.norm(c) == pytest.approx(1.0, abs=1e-12)
        assert prefix_sum_error(c, steps) <= prefix_sum_error(sqrt_coefficients(b), steps) * (1 + 1e-12)
        # the closed form of the error equals ||A C^{-1}||_F^2 computed with matrices
        n = 40
        a, cm = np.tril(np.ones((n, n))), _toeplitz(c, n)
        assert prefix_sum_error(c, n) == pytest.approx(np.linalg.norm(a @ np.linalg.inv(cm)) ** 2, rel=1e-9)
    assert strategy(1, 10) == (1.0,)


# --- the noise ----------------------------------------------------------------------------------------------------

def test_noise_covariance_is_sigma_squared_C_inverse_C_inverse_transposed():
    """Each coordinate is one independent run of the process over T steps: 40000 of them estimate the covariance."""
    b, steps, numel, sigma, clip = 3, 7, 40000, 2.0, 0.5
    c = strategy(b, steps)
    noise = BandedNoise(c, sigma, clip, numel, rank=0, seed=11)
    rows = []
    for t in range(steps):
        update = torch.zeros(numel)
        noise.add_(update, t)
        rows.append(update.double().numpy())
    x = np.stack(rows)  # steps x numel
    empirical = x @ x.T / numel
    cinv = np.linalg.inv(_toeplitz(c, steps))
    expected = (sigma * clip) ** 2 * cinv @ cinv.T
    assert np.abs(empirical - expected).max() < 0.03 * (sigma * clip) ** 2 * np.abs(cinv @ cinv.T).max()
    # and it is the noise of C w = z: z_t recovered exactly from the released w's (back-substitution)
    z = _toeplitz(c, steps) @ (x / (sigma * clip))
    assert abs(z.std() - 1.0) < 0.01


def test_the_buffer_is_b_times_the_model_on_rank_zero_and_nothing_elsewhere():
    numel = 1000
    for b in (1, 2, 8):
        noise = BandedNoise(strategy(b, 100), 1.0, 1.0, numel, rank=0)
        assert tuple(noise.ring.shape) == (b - 1, numel) and noise.memory_bytes == b * numel * 4
        assert BandedNoise(strategy(b, 100), 1.0, 1.0, numel, rank=1).memory_bytes == 0


def test_one_band_is_dp_sgd_noise_bit_for_bit():
    a, g = BandedNoise((1.0,), 1.3, 0.7, 500, rank=0, seed=5), GaussianNoise(1.3, 0.7, 500, rank=0, seed=5)
    for t in range(4):
        x, y = torch.zeros(500), torch.zeros(500)
        a.add_(x, t, scale=2.0)
        g.add_(y, t, scale=2.0)
        assert torch.equal(x, y)


def test_the_ring_restores_the_same_noise_and_refuses_a_skipped_step():
    c = strategy(4, 20)
    whole, first = BandedNoise(c, 1.0, 1.0, 64, 0, seed=3), BandedNoise(c, 1.0, 1.0, 64, 0, seed=3)
    for t in range(5):
        whole.add_(torch.zeros(64), t)
        first.add_(torch.zeros(64), t)
    resumed = BandedNoise(c, 1.0, 1.0, 64, 0, seed=3)
    resumed.load_state_dict(first.state_dict(), 5)
    for t in range(5, 12):
        x, y = torch.zeros(64), torch.zeros(64)
        whole.add_(x, t)
        resumed.add_(y, t)
        assert torch.equal(x, y)
    with pytest.raises(WorkbenchError, match="asked for step 3"):
        resumed.add_(torch.zeros(64), 3)
    with pytest.raises(WorkbenchError, match="does not fit step 6"):
        BandedNoise(c, 1.0, 1.0, 64, 0).load_state_dict(first.state_dict(), 6)
    with pytest.raises(WorkbenchError, match="no bandmf noise buffer"):
        BandedNoise(c, 1.0, 1.0, 64, 0).load_state_dict(None, 5)


# --- cyclic Poisson -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_cyclic_poisson_takes_each_example_at_most_once_every_b_steps_at_rate_p(world_size):
    n, per_device, b, steps = 1001, 8, 4, 400
    seen: dict[int, list[int]] = {}
    rates = []
    for rank in range(world_size):
        shard = banded_shard(train_shard(n, rank, world_size, "per_rank", per_device), b, world_size)
        assert shard.population == world_size * b * (n // world_size // b)
        assert shard.sample_rate == pytest.approx(b * per_device * world_size / shard.population)
        sampler = CyclicPoissonBatchSampler(shard, b, steps, seed=9, rank=rank)
        for step, batch in enumerate(sampler):
            assert set(batch) <= set(sampler.part(step)) <= set(shard.indices)
            for i in batch:
                seen.setdefault(i, []).append(step)
        rates.append(sum(len(v) for i, v in seen.items() if i in shard.indices) / (len(shard.indices) * steps / b))
    for steps_of in seen.values():
        assert all(later - earlier >= b and (later - earlier) % b == 0 for earlier, later in zip(steps_of, steps_of[1:]))
    assert len(seen) <= shard.population
    assert np.mean(rates) == pytest.approx(shard.sample_rate, rel=0.03)


def test_one_part_is_the_poisson_sampler_and_too_many_bands_are_refused():
    shard = train_shard(500, 0, 1, "per_rank", 16)
    cyclic = CyclicPoissonBatchSampler(banded_shard(shard, 1, 1), 1, 10, seed=4, rank=0)
    assert list(cyclic) == list(PoissonBatchSampler(shard, 10, seed=4, rank=0))
    with pytest.raises(WorkbenchError, match=r"num_bands <= 31"):
        banded_shard(shard, 40, 1)


# --- accounting ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["pld", "rdp", "prv"])
def test_bandmf_epsilon_is_dp_sgd_over_ceil_t_over_b_participations(kind):
    p, sigma, b = 0.05, 1.1, 4
    acc = BandMFAccountant(kind, p, sigma, b)
    for steps in (1, 4, 5, 403):
        assert acc.epsilon(steps, DELTA) == privacy.Accountant(kind, p, sigma).epsilon(participations(steps, b), DELTA)
    if kind == "pld":
        assert acc.epsilon(403, DELTA) == pytest.approx(direct_bandmf_epsilon(p, sigma, 403, b), rel=1e-9)
        back = accountant_of({"mechanism": "bandmf", "num_bands": b, "sample_rate": p, "noise_multiplier": sigma,
                              "world_size": 1, "shard": "per_rank"})
        assert back.epsilon(403, DELTA) == acc.epsilon(403, DELTA)
    state = acc.state_dict()
    assert BandMFAccountant.from_state_dict(state).num_bands == b
    with pytest.raises(WorkbenchError, match="must keep its privacy mechanism"):
        BandMFAccountant(kind, p, sigma, 2).load_state_dict(state)


ORACLE_CASES = [(1.0, 1000, 4, 0.04), (0.8, 300, 1, 0.1), (1.5, 997, 8, 0.2), (3.0, 200, 16, 0.9)]


def _oracle_python() -> Path | None:
    path = Path(os.environ.get("WORKBENCH_ORACLE_PYTHON", REPO / ".venv-oracle" / "bin" / "python"))
    return path if path.exists() else None


@pytest.mark.skipif(_oracle_python() is None and not os.environ.get("WORKBENCH_REQUIRE_ORACLE"),
                    reason="jax_privacy's venv (.venv-oracle, `make oracle`) is not here; CI sets "
                           "WORKBENCH_REQUIRE_ORACLE and installs it")
def test_bandmf_epsilon_agrees_with_jax_privacy():
    """jax_privacy 2.0.0's own amplified-BandMF event, composed by dp_accounting's PLD in its own process."""
    python = _oracle_python()
    assert python is not None, "WORKBENCH_REQUIRE_ORACLE is set but .venv-oracle is missing: run `make oracle`"
    script = ("import json, sys\nimport dp_accounting\n"
              "from jax_privacy.experimental.accounting import amplified_bandmf_event\nout = []\n"
              "for sigma, steps, b, p in json.loads(sys.argv[1]):\n"
              "    acc = dp_accounting.pld.PLDAccountant()\n"
              "    acc.compose(amplified_bandmf_event(sigma, steps, num_bands=b, sampling_prob=p))\n"
              f"    out.append(acc.get_epsilon({DELTA}))\nprint(json.dumps(out))\n")
    proc = subprocess.run([str(python), "-c", script, json.dumps(ORACLE_CASES)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for (sigma, steps, b, p), eps in zip(ORACLE_CASES, theirs):
        assert BandMFAccountant("pld", p, sigma, b).epsilon(steps, DELTA) == pytest.approx(eps, rel=0.01)
    assert theirs[0] == pytest.approx(4.18515, rel=1e-4)  # ENVIRONMENT's measured number


# --- the run ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["privacy.mechanism=fancy"], "privacy.mechanism='fancy' is unknown"),
    (["privacy.mechanism=bandmf", "shard=global"], "supports ddp_shard=per_rank only"),
    (["privacy.mechanism=bandmf", "privacy.clipping=adaptive"], "supports privacy.clipping=fixed only"),
    (["privacy.mechanism=bandmf", "privacy.num_bands=0"], "privacy.num_bands must be"),
    (["privacy.mechanism=blt", "shard=global"], "blt supports ddp_shard=per_rank only"),
    (["privacy.mechanism=blt", "privacy.clipping=adaptive"], "blt supports privacy.clipping=fixed only"),
    (["privacy.mechanism=blt", "privacy.blt_buffers=0"], "privacy.blt_buffers"),
    (["privacy.mechanism=blt", "experiment=users"], "blt supports privacy.unit=example only"),
])
def test_what_is_not_built_or_accounted_is_refused_in_one_line(make_cfg, overrides, message):
    from workbench import config
    from workbench.privacy.mechanism import check_settings

    with pytest.raises(WorkbenchError, match=message) as e:  # as the entry points ask, before any work
        cfg = make_cfg(*overrides)
        config.validate(cfg)
        check_settings(cfg)
    assert "\n" not in str(e.value)


def test_too_many_bands_or_a_noise_correcting_optimizer_is_refused_before_training(make_cfg):
    from workbench import train

    with pytest.raises(WorkbenchError, match=r"num_bands=6 makes the in-band sampling rate .* privacy.num_bands <= 5"):
        train(make_cfg("privacy.mechanism=bandmf", "privacy.num_bands=6", "max_steps=2"))
    with pytest.raises(WorkbenchError, match="noise is correlated"):  # DP-AdamBC's correction assumes sigma C / B
        train(make_cfg("experiment=quick", "privacy.mechanism=bandmf", "optimizer=dp_adamw", "max_steps=2"))


def test_the_default_job_with_bandmf_logs_the_independent_epsilon_on_every_line(make_cfg, mlflow_uri):
    """`python -m workbench privacy.mechanism=bandmf privacy.target_epsilon=1`: digits, B=256, 30 epochs, b=4."""
    from mlflow import MlflowClient

    from workbench import train

    result = train(make_cfg("privacy.mechanism=bandmf", "privacy.target_epsilon=1"))
    population = 1436  # 1437 digits cut to 4 equal parts
    p = 4 * 256 / population
    assert result.sample_rate == pytest.approx(p)
    assert result.epsilon <= 1.0
    assert result.epsilon == pytest.approx(direct_bandmf_epsilon(p, result.noise_multiplier, result.steps, 4), rel=1e-9)
    client = MlflowClient(tracking_uri=mlflow_uri)
    logged = client.get_metric_history(result.run_id, "epsilon")
    assert len(logged) >= 10
    for m in logged:  # each line its step's epsilon, or at most LINE_SLACK above it (a coarser PLD grid)
        fresh = direct_bandmf_epsilon(p, result.noise_multiplier, m.step, 4)
        assert fresh * (1 - 1e-9) <= m.value <= fresh * (1 + LINE_SLACK)
    event = json.loads(client.get_run(result.run_id).data.tags["workbench.dp_event"])
    assert event["mechanism"] == "bandmf" and event["num_bands"] == 4
    assert result.metrics["eval_accuracy"] > 0.3  # it learns (chance 0.1)


QUICK = ["experiment=quick", "privacy.mechanism=bandmf", "max_steps=20", "save_steps=5"]


def test_one_band_is_dp_sgd_end_to_end(make_cfg):
    from workbench import train

    args = ["experiment=quick", "privacy.secure_seed=3", "tracking.enabled=false", "privacy.noise_multiplier=1.0"]
    a = train(make_cfg(*args))
    b = train(make_cfg(*args, "privacy.mechanism=bandmf", "privacy.num_bands=1"))
    assert a.epsilon == b.epsilon and a.sample_rate == b.sample_rate
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))


def test_a_crashed_bandmf_run_resumes_bit_for_bit_and_its_ring_stays_out_of_mlflow(make_cfg, tmp_path, monkeypatch,
                                                                                   mlflow_uri):
    from mlflow import MlflowClient

    from workbench import train

    args = [*QUICK, "data.train._target_=tests.plugins.FailingSynthetic", "privacy.secure_seed=77"]
    crashed = tmp_path / "crashed"
    monkeypatch.setenv("WB_FAIL_AT_FETCH", "13")  # the pre-run check's fetch, then steps 0..10: fails in step 11
    with pytest.raises(RuntimeError, match="injected failure"):
        train(make_cfg(*args, f"output_dir={crashed}", "tracking.enabled=false"))
    monkeypatch.delenv("WB_FAIL_AT_FETCH")
    saved = checkpoint.load(checkpoint.list_checkpoints(crashed)[-1])
    assert saved["step"] == 10 and saved["correlated_noise"]["next_step"] == 10
    assert tuple(saved["correlated_noise"]["ring"].shape)[0] == 3  # b - 1 past draws
    resumed = train(make_cfg(*args, f"output_dir={crashed}", "resume_from_checkpoint=latest", "tracking.enabled=false"))
    whole = train(make_cfg(*args, f"output_dir={tmp_path / 'whole'}"))
    assert resumed.steps == whole.steps == 20 and resumed.epsilon == whole.epsilon
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), whole.model.parameters()))
    client = MlflowClient(tracking_uri=mlflow_uri)
    local = client.download_artifacts(whole.run_id, "checkpoints", str(tmp_path / "published"))
    published = checkpoint.load(next(Path(local).glob("*.pt")))
    assert "correlated_noise" not in published and "secret" not in published
    assert "correlated_noise" in checkpoint.load(whole.checkpoint)


def _train_on_rank(overrides):
    from workbench import compose, train

    result = train(compose(overrides))
    return [p.detach().clone() for p in result.model.parameters()], result.epsilon, result.sample_rate, result.steps, \
        result.noise_multiplier


@pytest.mark.slow
def test_two_gloo_ranks_stay_identical_and_report_the_independent_epsilon(tmp_path, mlflow_uri):
    from workbench import launch_distributed

    overrides = [f"output_dir={tmp_path}", f"tracking.uri={mlflow_uri}", "disable_tqdm=true", *QUICK]
    (p0, eps0, q0, steps, sigma), (p1, eps1, q1, _, _) = launch_distributed(_train_on_rank, 2, overrides)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1)) and eps0 == eps1
    assert q0 == q1 == pytest.approx(4 * 128 / 2048)  # b B / N_used, B = 64 x 2
    assert eps0 == pytest.approx(direct_bandmf_epsilon(q0, sigma, steps, 4), rel=1e-9)


@pytest.mark.slow
def test_two_gloo_ranks_resume_bit_for_bit(tmp_path, monkeypatch):
    """Both ranks fail in step 11 (each counts its own fetches); resumed at W=2 from rank 0's checkpoint 10 (its ring
    restored, rank 1 adds no noise), the run ends where an uninterrupted W=2 run ends."""
    from workbench import launch_distributed

    args = ["disable_tqdm=true", "tracking.enabled=false", *QUICK, "data.train._target_=tests.plugins.FailingSynthetic",
            "privacy.secure_seed=5"]
    crashed = tmp_path / "crashed"
    monkeypatch.setenv("WB_FAIL_AT_FETCH", "13")
    with pytest.raises(RuntimeError, match="injected failure"):
        launch_distributed(_train_on_rank, 2, [*args, f"output_dir={crashed}"])
    monkeypatch.delenv("WB_FAIL_AT_FETCH")
    assert checkpoint.list_checkpoints(crashed)[-1].name == "checkpoint-10.pt"
    resumed = launch_distributed(_train_on_rank, 2, [*args, f"output_dir={crashed}", "resume_from_checkpoint=latest"])
    whole = launch_distributed(_train_on_rank, 2, [*args, f"output_dir={tmp_path / 'whole'}"])
    for r in range(2):
        assert resumed[r][3] == whole[r][3] == 20 and resumed[r][1] == whole[r][1]
        assert all(torch.equal(a, b) for a, b in zip(resumed[r][0], whole[r][0]))


def test_the_benchmark_noise_row_keeps_b_times_the_model_and_adds_the_noise_it_times():
    """benchmarks/bandmf.py's noise row: what it reports kept is 1x, 4x, 16x and (blt, d = 4) 5x the buffer (no timing
    asserted)."""
    from benchmarks.bandmf import noise_cost

    row = noise_cost(numel=4096, block=2, repeats=1)["rows"]
    assert {k: v["bytes_kept"] for k, v in row.items()} == {"dpsgd": 4096 * 4, "bandmf b=4": 4 * 4096 * 4,
                                                            "bandmf b=16": 16 * 4096 * 4, "blt d=4": 5 * 4096 * 4}
    assert [v["memory_ratio_to_dpsgd"] for v in row.values()] == [1, 4, 16, 5]
    assert row["dpsgd"]["time_ratio_to_dpsgd"] == 1 and all(v["ms_per_step"] > 0 for v in row.values())
