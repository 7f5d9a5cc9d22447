"""`launcher=slurm` against a real SLURM with accounting (tests/slurm_cluster.py): jobs, sweeps, preemption."""

import os
import time

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import REPO, run_cli
from workbench import checkpoint, compose

pytestmark = pytest.mark.slow


def _runs(uri):
    client = MlflowClient(tracking_uri=uri)
    return client, client.search_runs([client.get_experiment_by_name("workbench").experiment_id])


def test_two_task_job_completes_as_one_run(slurm_cluster, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("launcher=slurm", "launcher.tasks_per_node=2", "backend=gloo", "experiment=quick",
                   "disable_tqdm=true", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    job_id = proc.stdout.split("submitted job ")[1].split()[0]
    assert slurm_cluster.wait_state(job_id, "COMPLETED", timeout=60) == "COMPLETED"
    _, runs = _runs(uri)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.metrics["world_size"] == 2 and run.data.tags["status"] == "finished"
    assert run.data.tags["job_id"] == job_id and run.data.tags["launcher"] == "slurm"
    run_dirs = list((tmp_path / "outputs").glob("*/*"))
    assert len(run_dirs) == 1  # one run folder chosen before submission
    logs = sorted(p.name for p in (run_dirs[0] / "submitit").glob("*_log.out"))
    assert logs == [f"{job_id}_0_log.out", f"{job_id}_1_log.out"]  # every rank's output is kept


def test_sweep_through_slurm_is_a_parent_with_two_children(slurm_cluster, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("-m", "launcher=slurm", "experiment=quick", "seed=0,1", "disable_tqdm=true", cwd=tmp_path,
                   env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _, runs = _runs(uri)
    parents = [r for r in runs if r.data.tags.get("workbench.role") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert sorted(c.data.params["seed"] for c in children) == ["0", "1"]
    assert all(c.info.status == "FINISHED" for c in children)


PREEMPT_ARGS = ["experiment=quick", "data.train._target_=tests.plugins.SlowSynthetic", "max_steps=60",
                "save_steps=5", "disable_tqdm=true", "privacy.secure_seed=99"]


def test_preempted_job_requeues_and_ends_like_an_uninterrupted_run(slurm_cluster, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("WB_FETCH_SLEEP", "0.15")  # ~9 s of training: time to preempt it mid-run
    monkeypatch.chdir(tmp_path)
    from workbench.launch import launch

    # timeout_min > 10: submitit 1.5.4 counts any USR2 in a shorter job as a timeout, not a preemption.
    cfg = compose([*PREEMPT_ARGS, f"output_dir={tmp_path / 'preempted'}", "launcher=slurm", "launcher.wait=false",
                   "launcher.timeout_min=30"])
    job = launch(cfg)
    while not checkpoint.list_checkpoints(tmp_path / "preempted"):  # polled on state; pytest-timeout bounds a hang
        assert not job.done(), "the job ended without writing its first checkpoint"
        time.sleep(0.2)
    job._interrupt()  # submitit's preemption path: USR2 -> Job.checkpoint() -> scontrol requeue
    slurm_cluster.release_requeued(job.job_id)
    result = job.result()
    assert slurm_cluster.requeue_count(job.job_id) == 1
    assert slurm_cluster.wait_state(job.job_id, "COMPLETED", timeout=60) == "COMPLETED"

    monkeypatch.setenv("WB_FETCH_SLEEP", "0")
    from workbench.run import train

    whole = train(compose([*PREEMPT_ARGS, f"output_dir={tmp_path / 'whole'}"]))
    assert result["epsilon"] == whole.epsilon and result["steps"] == whole.steps == 60
    a = checkpoint.load(checkpoint.list_checkpoints(tmp_path / "whole")[-1])
    b = checkpoint.load(checkpoint.list_checkpoints(tmp_path / "preempted")[-1])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])

    client, runs = _runs(uri)
    run = next(r for r in runs if r.info.run_id == result["run_id"])
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "learning_rate")]
    assert sorted(steps) == sorted(set(steps)) == list(range(5, 61, 5))  # resumed without logging a step twice


def test_slurm_bad_input_fails_with_sbatch_message(slurm_cluster, tmp_path):
    proc = run_cli("launcher=slurm", "launcher.partition=nosuchpartition", "experiment=quick", cwd=tmp_path)
    assert proc.returncode == 2
    assert "submission failed" in proc.stderr and "partition" in proc.stderr.lower()
    assert "Traceback" not in proc.stderr
    client, runs = _runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert [r.info.status for r in runs] == ["FAILED"]  # the run made at submission is not left RUNNING
    assert runs[0].data.tags["status"] == "failed" and "partition" in runs[0].data.tags["error"].lower()


def test_slurm_without_sbatch_fails_fast(tmp_path):
    env = {"PATH": os.path.dirname(os.sys.executable)}  # a PATH without SLURM's binaries
    proc = run_cli("launcher=slurm", "experiment=quick", cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "needs SLURM's sbatch" in proc.stderr


def test_local_launcher_rejects_zero_processes(tmp_path):
    proc = run_cli("launcher=local", "launcher.nprocs=0", cwd=tmp_path)
    assert proc.returncode == 2 and "launcher.nprocs must be >= 1" in proc.stderr


def test_local_launcher_runs_two_ranks_as_one_job(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("launcher=local", "launcher.nprocs=2", "experiment=quick", "shard=global", "disable_tqdm=true",
                   cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _, runs = _runs(uri)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].data.metrics["world_size"] == 2
    assert runs[0].data.tags["ddp_shard"] == "global" and runs[0].data.tags["status"] == "finished"
    # The closing line an inline run prints, with the job id: delta and the command that opens the MLflow UI.
    (closing,) = [line for line in proc.stdout.splitlines() if line.startswith("done:")]
    assert f"at delta={runs[0].data.metrics['delta']:.1e}" in closing and f"run_id={runs[0].info.run_id}" in closing
    assert f"job_id={runs[0].data.tags['job_id']}" in closing
    assert closing.endswith(f"mlflow ui --backend-store-uri {uri}, then open http://127.0.0.1:5000/#/experiments/"
                            f"{runs[0].info.experiment_id}/runs/{runs[0].info.run_id}?workflowType=machine_learning")


def test_local_launcher_fails_when_a_rank_fails(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # A failure inside the job (compute_metrics is resolved by the ranks, after submission) fails the launch.
    proc = run_cli("launcher=local", "launcher.nprocs=2", "experiment=quick", "compute_metrics=os.path.nosuch",
                   cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 2
    assert "failed" in proc.stderr and "compute_metrics='os.path.nosuch'" in proc.stderr
    _, runs = _runs(uri)
    assert [r.info.status for r in runs] == ["FAILED"] and runs[0].data.tags["status"] == "failed"
    assert "compute_metrics='os.path.nosuch'" in runs[0].data.tags["error"]  # the error is recorded on the run


@pytest.mark.parametrize("plugin", ["submitit_local", "submitit_slurm"])
def test_hydra_submitit_plugin_jobs_detect_their_ranks(request, tmp_path, plugin):
    if plugin == "submitit_slurm":
        request.getfixturevalue("slurm_cluster")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("-m", f"hydra/launcher={plugin}", "hydra.launcher.tasks_per_node=2", "experiment=quick",
                   "disable_tqdm=true", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _, runs = _runs(uri)
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 1  # every rank ran the task function, one run per job
    assert children[0].info.status == "FINISHED" and children[0].data.metrics["world_size"] == 2


def test_a_scancelled_job_ends_its_run_killed_and_its_log_says_how_to_resume(slurm_cluster, tmp_path):
    """scancel sends SIGTERM (no USR2) and SIGKILL after KillWait; submitit ignores SIGTERM in its tasks. The run must
    end KILLED, not stay RUNNING, with the resume hint in rank 0's job log; the hint, run as printed, finishes it."""
    import re
    import shlex
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    env = slurm_cluster.env({**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                             "MLFLOW_TRACKING_URI": uri, "WB_FETCH_SLEEP": "0.15"})
    proc = run_cli("launcher=slurm", "launcher.tasks_per_node=2", "backend=gloo", "launcher.wait=false",
                   "experiment=quick", "data.train._target_=tests.plugins.SlowSynthetic", "max_steps=60", "save_steps=5",
                   "disable_tqdm=true", f"output_dir={run_dir}", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    job_id = proc.stdout.split("submitted job ")[1].split()[0]
    while not checkpoint.list_checkpoints(run_dir):  # polled on state; pytest-timeout bounds a hang
        assert slurm_cluster.job_state(job_id).split()[0] in ("PENDING", "RUNNING"), slurm_cluster.job_state(job_id)
        time.sleep(0.2)
    subprocess.run(["scancel", job_id], env=env, check=True)
    while slurm_cluster.run_cmd("squeue", "-h", "-j", job_id, check=False).stdout.strip():  # until every task is gone
        time.sleep(0.2)
    sacct = slurm_cluster.run_cmd("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State", check=False).stdout
    assert sacct.startswith("CANCELLED"), sacct

    client, runs = _runs(uri)
    assert [r.info.status for r in runs] == ["KILLED"] and runs[0].data.tags["status"] == "killed"
    log = (run_dir / "submitit" / f"{job_id}_0_log.err").read_text()
    hint = re.search(r"^interrupted at step \d+ by SIGTERM; resume with: (.*)$", log, re.M)
    assert hint, log[-3000:]
    assert "launcher=slurm" in hint.group(1) and hint.group(1).endswith(f"output_dir={run_dir} resume_from_checkpoint=latest")
    newest = checkpoint.list_checkpoints(run_dir)[-1]
    assert checkpoint.load(newest)["step"] == int(newest.stem.split("-")[1])  # whole

    assert hint.group(1).startswith("python -m workbench ")  # run as the user would, with this environment's python
    command = shlex.quote(sys.executable) + hint.group(1)[len("python"):]
    resumed = subprocess.run(["sh", "-c", command], cwd=tmp_path, env={**env, "WB_FETCH_SLEEP": "0"},
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    second = resumed.stdout.split("submitted job ")[1].split()[0]
    assert slurm_cluster.wait_state(second, "COMPLETED", timeout=120).startswith("COMPLETED")
    _, runs = _runs(uri)
    assert [r.info.status for r in runs] == ["FINISHED"]  # the same run, continued to the end
    assert checkpoint.load(checkpoint.list_checkpoints(run_dir)[-1])["step"] == 60
