"""Correlated noise by a Buffered Linear Toeplitz strategy (privacy.mechanism=blt, issue 22): the strategy against
jax_privacy 2.0.0 (a separate venv, tests/test_bandmf.py's oracle), the sensitivity against a dense computation, the
noise against sigma C (C^{-1} Z) computed densely, the fixed-batch participation, the epsilon against dp_accounting
built here, and a whole run: every logged epsilon, resume bit for bit, the buffers out of MLflow."""

import json
import os
import subprocess
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import PLDAccountant

from tests.test_bandmf import _oracle_python
from workbench import checkpoint, privacy
from workbench.errors import WorkbenchError
from workbench.privacy.accounting.accountant import LINE_SLACK
from workbench.privacy.accounting.banded import accountant_of
from workbench.privacy.accounting.blt import BLTAccountant, calibrate_blt
from workbench.privacy.blt import BLT, loss, rational_sqrt, sensitivity, strategy
from workbench.privacy.correlated import BLTNoise
from workbench.privacy.cyclic import FixedBatchSampler, fixed_batch_shard
from workbench.privacy.sampling import train_shard

DELTA = 1e-5
SOME = BLT((0.99, 0.9, 0.5, 0.1), (0.05, 0.1, 0.1, 0.05))  # a hand-made BLT, coefficients positive and decreasing


def dense_sensitivity(c_matrix: np.ndarray, k: int) -> float:
    """max over parts s of ||sum of C's columns s, s+k, ...||, from the dense matrix (every part, no shortcut)."""
    n = len(c_matrix)
    return max(np.linalg.norm(c_matrix[:, s::k].sum(axis=1)) for s in range(min(k, n)))


def direct_epsilon(sigma: float, sens: float, delta: float = DELTA) -> float:
    acc = PLDAccountant(value_discretization_interval=privacy.DEFAULT_PLD_DISCRETIZATION)
    return acc.compose(dp_accounting.GaussianDpEvent(sigma / sens)).get_epsilon(delta)


# --- the strategy, against jax_privacy ----------------------------------------------------------------------------

ORACLE = """
import json, sys
import jax; jax.config.update("jax_enable_x64", True)
from jax_privacy.matrix_factorization import buffered_toeplitz as bt, toeplitz
out = []
for d, theta, scale, n, k in json.loads(sys.argv[1]):
    blt = bt.BufferedToeplitz.build(theta, scale)
    init = bt.get_init_blt(d)
    out.append({"init": [list(map(float, init.buf_decay)), list(map(float, init.output_scale))],
                "coefs": list(map(float, blt.toeplitz_coefs(n))),
                "inv_coefs": list(map(float, blt.inverse().toeplitz_coefs(n))),
                "sens2": float(toeplitz.minsep_sensitivity_squared(blt.toeplitz_coefs(n), k)),
                "loss": float(bt.LossFn.build_min_sep(n, error="mean", min_sep=k).loss(blt))})
print(json.dumps(out))
"""


@pytest.mark.skipif(_oracle_python() is None and not os.environ.get("WORKBENCH_REQUIRE_ORACLE"),
                    reason="jax_privacy's venv (.venv-oracle, `make oracle`) is not here")
def test_the_blt_its_inverse_sensitivity_loss_and_epsilon_agree_with_jax_privacy():
    python = _oracle_python()
    assert python is not None, "WORKBENCH_REQUIRE_ORACLE is set but .venv-oracle is missing: run `make oracle`"
    optimised = strategy(3, 60, 8)
    cases = [(4, SOME, 50, 7), (3, optimised, 60, 8)]  # two: jax's import and jit are most of a minute
    proc = subprocess.run([str(python), "-c", ORACLE, json.dumps(
        [(d, list(b.buf_decay), list(b.output_scale), n, k) for d, b, n, k in cases])], capture_output=True,
        text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (d, blt, n, k), theirs in zip(cases, json.loads(proc.stdout.strip().splitlines()[-1])):
        start = rational_sqrt(d)
        np.testing.assert_allclose([start.buf_decay, start.output_scale], theirs["init"], rtol=1e-9)
        np.testing.assert_allclose(blt.toeplitz_coefs(n), theirs["coefs"], rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(blt.inverse().toeplitz_coefs(n), theirs["inv_coefs"], rtol=1e-7, atol=1e-12)
        sens = float(sensitivity(blt, n, k)[-1])
        assert sens**2 >= theirs["sens2"] and sens**2 == pytest.approx(theirs["sens2"], rel=1e-6)
        assert loss(blt, n, k) == pytest.approx(theirs["loss"], rel=1e-6)
        sigma = 3.0 * sens  # epsilon on jax_privacy's sensitivity, from dp_accounting directly: within 1 %
        ours = BLTAccountant("pld", sigma, blt, k, n).epsilon(n, DELTA)
        assert ours == pytest.approx(direct_epsilon(sigma, theirs["sens2"] ** 0.5), rel=0.01)
    assert loss(optimised, 60, 8) < loss(rational_sqrt(3), 60, 8)  # the optimiser improved on its start


def test_the_sensitivity_of_every_prefix_is_the_worst_part_of_the_dense_matrix():
    for blt, n, k in ((SOME, 30, 4), (rational_sqrt(3), 25, 1), (rational_sqrt(4), 17, 17), (SOME, 40, 9)):
        sens = sensitivity(blt, n, k)
        for t in (1, 2, k, n // 2, n):
            assert sens[t - 1] == pytest.approx(dense_sensitivity(blt.materialize(t), k), rel=1e-8)  # the margin
            assert sens[t - 1] >= dense_sensitivity(blt.materialize(t), k)  # never below
    with pytest.raises(WorkbenchError, match="negative or increasing"):
        sensitivity(BLT((0.5,), (-0.7,)), 10, 2)


# --- the noise ----------------------------------------------------------------------------------------------------

def test_the_noise_is_sigma_clip_c_inverse_z_computed_densely_and_keeps_d_plus_one_model_vectors():
    steps, numel, sigma, clip = 12, 50, 1.7, 0.4
    noise = BLTNoise(SOME, sigma, clip, numel, rank=0, seed=9, dtype=torch.float64)
    released = []
    for t in range(steps):
        update = torch.zeros(numel, dtype=torch.float64)
        noise.add_(update, t)
        released.append(update.numpy())
    from workbench.privacy.sampling import NOISE_STREAM, step_generator
    z = np.stack([torch.randn(numel, generator=step_generator(9, 0, t, stream=NOISE_STREAM), dtype=torch.float64)
                  .numpy() for t in range(steps)])
    expected = sigma * clip * np.linalg.solve(SOME.materialize(steps), z)
    np.testing.assert_allclose(np.stack(released), expected, rtol=1e-9, atol=1e-12)
    assert BLTNoise(SOME, 1.0, 1.0, 1000, rank=0).memory_bytes == 5 * 1000 * 4  # d = 4 buffers + the draw
    assert BLTNoise(SOME, 1.0, 1.0, 1000, rank=1).memory_bytes == 0  # rank 0 alone adds noise


def test_the_buffers_restore_the_same_noise_and_refuse_a_skipped_step_or_another_blt():
    whole, first = BLTNoise(SOME, 1.0, 1.0, 64, 0, seed=3), BLTNoise(SOME, 1.0, 1.0, 64, 0, seed=3)
    for t in range(5):
        whole.add_(torch.zeros(64), t)
        first.add_(torch.zeros(64), t)
    resumed = BLTNoise(SOME, 1.0, 1.0, 64, 0, seed=3)
    resumed.load_state_dict(first.state_dict(), 5)
    for t in range(5, 12):
        x, y = torch.zeros(64), torch.zeros(64)
        whole.add_(x, t)
        resumed.add_(y, t)
        assert torch.equal(x, y)
    with pytest.raises(WorkbenchError, match="asked for step 3"):
        resumed.add_(torch.zeros(64), 3)
    with pytest.raises(WorkbenchError, match="do not fit step 6"):
        BLTNoise(SOME, 1.0, 1.0, 64, 0).load_state_dict(first.state_dict(), 6)
    with pytest.raises(WorkbenchError, match="do not fit"):
        BLTNoise(rational_sqrt(4), 1.0, 1.0, 64, 0).load_state_dict(first.state_dict(), 5)


# --- participation ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2])
def test_fixed_batches_take_each_example_exactly_at_the_steps_of_its_part(world_size):
    n, per_device, steps = 203, 10, 47
    shards = [fixed_batch_shard(train_shard(n, r, world_size, "per_rank", per_device), world_size)
              for r in range(world_size)]
    k = (n // world_size) // per_device
    seen: dict[int, list[int]] = {}
    for rank, shard in enumerate(shards):
        assert shard.population == world_size * k * per_device and shard.sample_rate == 1 / k
        sampler = FixedBatchSampler(shard, world_size, steps, seed=4, rank=rank)
        for t, batch in enumerate(sampler):
            assert len(batch) == per_device and set(batch) <= set(shard.indices)
            for i in batch:
                seen.setdefault(i, []).append(t)
        assert list(FixedBatchSampler(shard, world_size, steps, 4, rank, start_step=30)) == \
            [sampler.indices_for_step(t) for t in range(30, steps)]  # a resumed run walks the same batches
    assert len(seen) == world_size * k * per_device  # every kept example takes part
    for times in seen.values():
        assert times == list(range(times[0], steps, k)) and times[0] < k  # exactly every k steps from its part
    other = FixedBatchSampler(shards[0], world_size, steps, seed=5, rank=0)
    assert other.indices_for_step(0) != FixedBatchSampler(shards[0], world_size, steps, 4, 0).indices_for_step(0)


# --- accounting ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_blt_epsilon_is_the_gaussian_at_sigma_over_the_prefix_sensitivity(kind):
    blt, k, steps = rational_sqrt(3), 6, 40
    sigma = calibrate_blt(kind, blt, k, steps, 2.0, DELTA)
    acc = BLTAccountant(kind, sigma, blt, k, steps)
    assert acc.epsilon(steps, DELTA) <= 2.0
    assert acc.epsilon(steps, DELTA) > 1.9  # calibrated, not merely safe
    for t in (1, 7, 20, steps):
        sens = dense_sensitivity(blt.materialize(t), k)
        if kind == "pld":
            assert acc.epsilon(t, DELTA) == pytest.approx(direct_epsilon(sigma, sens), rel=1e-6)
        else:
            rdp = dp_accounting.rdp.RdpAccountant().compose(dp_accounting.GaussianDpEvent(sigma / sens))
            assert acc.epsilon(t, DELTA) == pytest.approx(rdp.get_epsilon(DELTA), rel=1e-6)
    assert acc.max_steps(acc.epsilon(20, DELTA), DELTA, steps) == 20  # the budget stop reads the same curve
    fields = {"noise_multiplier": sigma, "world_size": 1, "shard": "per_rank", "mechanism": "blt", "min_sep": k,
              "buf_decay": list(blt.buf_decay), "output_scale": list(blt.output_scale), "strategy_steps": steps}
    assert accountant_of(fields, kind).epsilon(steps, DELTA) == acc.epsilon(steps, DELTA)  # what a sweep composes
    assert BLTAccountant.from_state_dict(acc.state_dict()).epsilon(steps, DELTA) == acc.epsilon(steps, DELTA)
    with pytest.raises(WorkbenchError, match="must keep its privacy mechanism"):
        BLTAccountant(kind, sigma, blt, k + 1, steps).load_state_dict(acc.state_dict())


# --- the run ------------------------------------------------------------------------------------------------------

QUICK = ["experiment=quick", "privacy.mechanism=blt", "privacy.blt_buffers=3", "max_steps=20", "save_steps=5",
         "privacy.target_epsilon=3"]


def test_a_blt_run_logs_the_direct_epsilon_resumes_bit_for_bit_and_keeps_its_buffers_out_of_mlflow(
        make_cfg, tmp_path, monkeypatch, mlflow_uri):
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
    assert tuple(saved["correlated_noise"]["buffers"].shape)[0] == 3  # d buffers
    resumed = train(make_cfg(*args, f"output_dir={crashed}", "resume_from_checkpoint=latest", "tracking.enabled=false"))
    whole = train(make_cfg(*args, f"output_dir={tmp_path / 'whole'}"))
    assert resumed.steps == whole.steps == 20 and resumed.epsilon == whole.epsilon
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), whole.model.parameters()))

    client = MlflowClient(tracking_uri=mlflow_uri)
    event = json.loads(client.get_run(whole.run_id).data.tags["workbench.dp_event"])
    assert event["mechanism"] == "blt" and event["min_sep"] == 32 and event["strategy_steps"] == 20  # 2048 / 64
    blt = BLT(tuple(event["buf_decay"]), tuple(event["output_scale"]))
    assert whole.epsilon <= 3.0
    for m in client.get_metric_history(whole.run_id, "epsilon"):  # every logged line, from the dense matrix
        sens = dense_sensitivity(blt.materialize(m.step), 32)  # at most LINE_SLACK above (a coarser PLD grid)
        fresh = direct_epsilon(whole.noise_multiplier, sens)
        assert fresh * (1 - 1e-6) <= m.value <= fresh * (1 + LINE_SLACK)
    local = client.download_artifacts(whole.run_id, "checkpoints", str(tmp_path / "published"))
    published = checkpoint.load(next(Path(local).glob("*.pt")))
    assert "correlated_noise" not in published and "secret" not in published
    assert "correlated_noise" in checkpoint.load(whole.checkpoint)


@pytest.mark.slow
def test_two_gloo_ranks_stay_identical_report_the_direct_epsilon_and_resume_bit_for_bit(tmp_path, monkeypatch):
    """W = 2: batch t mod k of each rank's shard (k = 2048 / (2 x 64) = 16), noise from rank 0's buffers alone;
    both ranks fail in step 11 and resume from rank 0's checkpoint 10 to where an uninterrupted W = 2 run ends."""
    from tests.test_bandmf import _train_on_rank
    from workbench import launch_distributed

    args = ["disable_tqdm=true", "tracking.enabled=false", *QUICK, "data.train._target_=tests.plugins.FailingSynthetic",
            "privacy.secure_seed=5"]
    whole = launch_distributed(_train_on_rank, 2, [*args, f"output_dir={tmp_path / 'whole'}"])
    (p0, eps0, q0, steps, sigma), (p1, eps1, q1, _, _) = whole
    assert all(torch.equal(a, b) for a, b in zip(p0, p1)) and eps0 == eps1 and q0 == q1 == 1 / 16
    blt = strategy(3, 20, 16)  # the run's (T, k, d): the same parameters the run cached
    assert eps0 == pytest.approx(direct_epsilon(sigma, dense_sensitivity(blt.materialize(steps), 16)), rel=1e-6)
    crashed = tmp_path / "crashed"
    monkeypatch.setenv("WB_FAIL_AT_FETCH", "13")
    with pytest.raises(RuntimeError, match="injected failure"):
        launch_distributed(_train_on_rank, 2, [*args, f"output_dir={crashed}"])
    monkeypatch.delenv("WB_FAIL_AT_FETCH")
    assert checkpoint.list_checkpoints(crashed)[-1].name == "checkpoint-10.pt"
    resumed = launch_distributed(_train_on_rank, 2, [*args, f"output_dir={crashed}", "resume_from_checkpoint=latest"])
    for r in range(2):
        assert resumed[r][3] == whole[r][3] == 20 and resumed[r][1] == whole[r][1]
        assert all(torch.equal(a, b) for a, b in zip(resumed[r][0], whole[r][0]))


def test_blt_noise_is_the_same_whatever_the_clipping_route_micro_batches_or_precision(make_cfg):
    """The correlated noise is drawn after clipping, at the step's one place: routes that clip alike (bk in one
    physical batch, hooks in micro-batches of 16, bk under bf16 autocast) train to the same model up to rounding."""
    from workbench import train

    args = ["experiment=quick", "privacy.mechanism=blt", "privacy.blt_buffers=2", "max_steps=6",
            "tracking.enabled=false", "privacy.secure_seed=8", "privacy.noise_multiplier=2.0"]
    runs = [train(make_cfg(*args, *extra)) for extra in (["privacy.grad_sample_mode=bk"],
                                                         ["privacy.grad_sample_mode=hooks", "max_physical_batch_size=16"],
                                                         ["privacy.grad_sample_mode=bk", "bf16=true"])]
    assert len({r.epsilon for r in runs}) == 1 and runs[0].steps == 6
    for other, tol in ((runs[1], 1e-5), (runs[2], 1e-2)):  # bf16: ~1e-3 here; another noise draw: ~0.2
        for a, b in zip(runs[0].model.parameters(), other.model.parameters()):
            assert torch.allclose(a, b, atol=tol), (a - b).abs().max()


def test_a_sweep_of_blt_points_composes_each_distinct_mechanism():
    """Two blt points with the same sigma but different k are different mechanisms: the best-of-K bound must take
    the worse one, not whichever a (q, sigma) key kept."""
    from workbench.privacy.accounting.tuning import profile_epsilon

    blt = rational_sqrt(2)
    loose, tight = BLTAccountant("pld", 6.0, blt, 2, 30), BLTAccountant("pld", 6.0, blt, 10, 30)
    assert loose.epsilon(30, DELTA) > tight.epsilon(30, DELTA)
    both = profile_epsilon([(loose, 30), (tight, 30)], DELTA, "poisson")
    assert both >= profile_epsilon([(loose, 30)], DELTA, "poisson") > \
        profile_epsilon([(tight, 30)], DELTA, "poisson")


@pytest.mark.parametrize("mechanism", [["privacy.mechanism=bandmf", "privacy.num_bands=2"],
                                       ["privacy.mechanism=blt", "privacy.blt_buffers=2"]], ids=["bandmf", "blt"])
def test_correlated_noise_trains_a_lora_adapter_and_only_the_adapter(make_cfg, mechanism):
    """LoRA: the correlated noise lives in the flat buffer of the trainable parameters, the adapter's alone: the base
    stays frozen, the adapter's B matrices (zero at the start) move, and the run's epsilon is its mechanism's."""
    from workbench import train

    result = train(make_cfg("experiment=lm_lora", *mechanism, "max_steps=4", "tracking.enabled=false",
                            "privacy.secure_seed=5"))
    assert result.steps == 4 and 0 < result.epsilon <= 8.0
    trainable = {n: p for n, p in result.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    lora_b = [p for n, p in trainable.items() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 and torch.isfinite(p).all() for p in lora_b)
