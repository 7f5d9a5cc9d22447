"""BandMF through the real CLI (issue 22's "done when"): `python -m workbench privacy.mechanism=bandmf
privacy.target_epsilon=1` SIGKILLed after a checkpoint and resumed ends bit for bit where an uninterrupted run ends,
with the same epsilon; and the same job under real torchrun with two ranks is one FINISHED run whose epsilon is
amplified BandMF's, computed here with dp_accounting."""

import math

import dp_accounting
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from mlflow import MlflowClient

from tests.conftest import run_cli
from workbench import checkpoint, privacy

pytestmark = pytest.mark.slow

DELTA = 1e-5
# quick-sized: synthetic data (2048 examples), B = 64 per rank, 20 steps, a checkpoint every 5; b = 4 bands.
# A fixed secure_seed makes two separate runs comparable bit for bit.
ARGS = ["experiment=quick", "privacy.mechanism=bandmf", "privacy.target_epsilon=1", "privacy.num_bands=4",
        "max_steps=20", "save_steps=5", "save_total_limit=2", "disable_tqdm=true", "privacy.secure_seed=2211"]


def bandmf_epsilon(p, sigma, steps, b, delta=DELTA):
    """Amplified BandMF from dp_accounting directly: Poisson(p) Gaussian(sigma) composed ceil(T / b) times."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(sigma)), math.ceil(steps / b))
    acc = PLDAccountant(value_discretization_interval=privacy.DEFAULT_PLD_DISCRETIZATION)
    return acc.compose(event).get_epsilon(delta)


def _runs(uri):
    client = MlflowClient(tracking_uri=uri)
    return client, client.search_runs([client.get_experiment_by_name("workbench").experiment_id])


def test_a_bandmf_cli_run_killed_by_sigkill_resumes_bit_for_bit_with_the_same_epsilon(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri}
    dying = "data.train._target_=tests.plugins.DyingSynthetic"  # plain Synthetic unless WB_KILL_AT_FETCH is set
    whole = run_cli(*ARGS, dying, f"output_dir={tmp_path / 'whole'}", cwd=tmp_path, env=env)
    assert whole.returncode == 0, whole.stderr[-2000:]

    crashed = run_cli(*ARGS, dying, f"output_dir={tmp_path / 'crashed'}", cwd=tmp_path,
                      env={**env, "WB_KILL_AT_FETCH": "13"})
    assert crashed.returncode == -9  # SIGKILL mid-run, after the checkpoints at 5 and 10
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "crashed")] == ["checkpoint-5.pt",
                                                                                   "checkpoint-10.pt"]
    ring = checkpoint.load(checkpoint.list_checkpoints(tmp_path / "crashed")[-1])["correlated_noise"]
    assert ring["next_step"] == 10 and tuple(ring["ring"].shape)[0] == 3  # the b - 1 past draws were saved
    resumed = run_cli(*ARGS, dying, f"output_dir={tmp_path / 'crashed'}", "resume_from_checkpoint=latest",
                      cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    a = checkpoint.load(checkpoint.list_checkpoints(tmp_path / "whole")[-1])
    b = checkpoint.load(checkpoint.list_checkpoints(tmp_path / "crashed")[-1])
    assert a["step"] == b["step"] == 20
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    # the resume had past noise to restore (a ring of zeros would make the comparison above a weaker check)
    assert ring["ring"].abs().sum() > 0

    client, runs = _runs(uri)
    by_dir = {r.data.params["output_dir"]: r for r in runs}
    assert len(by_dir) == 2  # the resumed job continued its own run
    run_a, run_b = by_dir[str(tmp_path / "whole")], by_dir[str(tmp_path / "crashed")]
    assert run_a.info.status == run_b.info.status == "FINISHED"
    ma, mb = run_a.data.metrics, run_b.data.metrics
    assert ma["epsilon"] == mb["epsilon"] and ma["noise_multiplier"] == mb["noise_multiplier"]
    p = 4 * 64 / 2048
    assert ma["sample_rate"] == pytest.approx(p)
    assert mb["epsilon"] <= 1.0
    assert mb["epsilon"] == pytest.approx(bandmf_epsilon(p, mb["noise_multiplier"], 20, 4), rel=1e-9)
    eps_steps = [m.step for m in client.get_metric_history(run_b.info.run_id, "epsilon")]
    assert sorted(eps_steps) == sorted(set(eps_steps)) and 20 in eps_steps  # no line logged twice across the kill


def test_bandmf_under_torchrun_with_two_ranks_is_one_finished_run_with_the_independent_epsilon(tmp_path):
    proc = run_cli("--standalone", "--nproc-per-node=2", "-m", "workbench", "backend=gloo", *ARGS,
                   cwd=tmp_path, timeout=600, module=("-m", "torch.distributed.run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, runs = _runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert len(runs) == 1  # one run per job, not one per rank
    run = runs[0]
    m = run.data.metrics
    assert run.info.status == "FINISHED" and m["world_size"] == 2 and int(m["steps"]) == 20
    p = 4 * (64 * 2) / 2048  # b B / N, B = 64 per rank x 2 ranks; 2048 is a multiple of W b = 8: nothing cut
    assert m["sample_rate"] == pytest.approx(p)
    assert m["epsilon"] <= 1.0
    assert m["epsilon"] == pytest.approx(bandmf_epsilon(p, m["noise_multiplier"], 20, 4), rel=1e-9)
    # the epsilon is not DP-SGD's over all 20 steps at this rate (that would be larger): the amplification is counted
    assert m["epsilon"] < bandmf_epsilon(p, m["noise_multiplier"], 20, 1) * 0.9
