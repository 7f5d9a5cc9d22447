"""Tests against a REAL single-node SLURM cluster with accounting (see tests/slurm_cluster.py).

Skipped when SLURM is not available (not root / not installed: run .ci/install_slurm.sh), a hard failure with
WORKBENCH_REQUIRE_SLURM=1. Job functions live at module level so submitit pickles them by reference
(``tests.test_slurm_cluster.<name>``); the executor puts the repo root on the job's PYTHONPATH.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- job functions (run inside SLURM)


def gloo_all_reduce(value_offset: float) -> dict:
    """Every rank contributes rank + value_offset; returns the all-reduced sum and the rank's view of the world."""
    import submitit
    import torch
    import torch.distributed as dist

    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(env.rank) + value_offset])
        dist.all_reduce(t)
        return {"rank": env.rank, "world_size": env.world_size, "sum": float(t.item()),
                "job_id": os.environ["SLURM_JOB_ID"]}
    finally:
        dist.destroy_process_group()


class PreemptibleCounter:
    """A submitit Checkpointable-style callable: waits to be preempted on its first attempt.

    Attempt 1 writes ``started-1`` and sleeps until signalled (``job._interrupt()``); submitit calls
    ``checkpoint()`` (which carries ``attempt + 1`` into the re-submitted callable) and runs
    ``scontrol requeue``. Attempt 2 returns immediately.
    """

    def __init__(self, marker_dir: str, attempt: int = 1) -> None:
        self.marker_dir = marker_dir
        self.attempt = attempt

    def __call__(self) -> dict:
        Path(self.marker_dir, f"started-{self.attempt}").write_text(os.environ.get("SLURM_RESTART_COUNT", "0"))
        if self.attempt == 1:
            time.sleep(300)  # the test preempts us long before this
        return {"attempt": self.attempt, "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0"))}

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(PreemptibleCounter(self.marker_dir, self.attempt + 1))


def requeue_myself_once() -> int:
    """Requeues its own job (what submitit's handler does) on the first run; returns SLURM_RESTART_COUNT."""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if restarts == 0:
        subprocess.check_call(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]])
        time.sleep(300)  # slurmctld kills this attempt (SIGTERM, then SIGKILL after KillWait)
    return restarts


# --------------------------------------------------------------------------- helpers


def _final_state(job, timeout: float = 60.0) -> str:
    """The sacct state once the job left RUNNING/COMPLETING (submitit's own view, forced refresh)."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = job.get_info(mode="force").get("State", "")
        if state and state.split()[0] not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "UNKNOWN"):
            return state
        time.sleep(0.5)
    return state


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.1)


# --------------------------------------------------------------------------- tests


def test_cluster_is_up(slurm_cluster: SlurmCluster):
    assert os.environ["SLURM_CONF"] == str(slurm_cluster.conf)
    out = slurm_cluster.run_cmd("sinfo", "-h", "-o", "%P %t %c").stdout.split()
    assert out[0].rstrip("*") == "debug" and out[1] == "idle" and int(out[2]) == (os.cpu_count() or 1)
    assert set(slurm_cluster.pids()) == {"munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd"}
    # accounting: the cluster is registered in slurmdbd
    assert "local" in slurm_cluster.run_cmd("sacctmgr", "-n", "-P", "show", "cluster", "format=Cluster").stdout


def test_srun_two_tasks(slurm_cluster: SlurmCluster):
    r = subprocess.run(["srun", "-n", "2", "hostname"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 2


def test_submitit_gloo_all_reduce_and_accounting(slurm_cluster: SlurmCluster, tmp_path):
    import submitit

    ex = slurm_cluster.executor(tmp_path / "jobs", nodes=1, ntasks_per_node=2, cpus_per_task=1, timeout_min=5)
    assert isinstance(ex, submitit.SlurmExecutor)
    t0 = time.monotonic()
    job = ex.submit(gloo_all_reduce, 10.0)
    results = job.results()
    elapsed = time.monotonic() - t0
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert all(r["sum"] == 21.0 for r in results)  # (0 + 10) + (1 + 10)
    assert all(r["job_id"] == job.job_id for r in results)
    assert _final_state(job) == "COMPLETED"  # accounting works: not UNKNOWN
    assert elapsed < 60, elapsed


def test_preemption_via_submitit_interrupt_requeues(slurm_cluster: SlurmCluster, tmp_path):
    import submitit

    markers = tmp_path / "markers"
    markers.mkdir()
    # timeout_min > 10: submitit 1.5.4 calls any USR2 in a shorter job a time-out, not a preemption
    ex = slurm_cluster.executor(tmp_path / "jobs", ntasks_per_node=1, cpus_per_task=1, timeout_min=30)
    job = ex.submit(PreemptibleCounter(str(markers)))
    _wait_for(markers / "started-1")  # the function runs => submitit's USR2 handler is installed
    job._interrupt()  # scancel --signal SIGTERM, then --signal USR2: a preemption
    slurm_cluster.release_requeued(job.job_id)  # skip slurmctld's ~11 s BeginTime hold on requeued jobs
    result = job.result()
    assert result == {"attempt": 2, "restart_count": 1}
    logs = (job.stdout() or "") + (job.stderr() or "")
    assert "this job is preempted" in logs and "Requeued job" in logs, logs
    assert slurm_cluster.requeue_count(job.job_id) == 1
    assert _final_state(job) == "COMPLETED"
    assert isinstance(ex, submitit.SlurmExecutor)


def test_job_requeues_itself_with_scontrol(slurm_cluster: SlurmCluster, tmp_path):
    """No release_requeued(): slurmctld's own hold (cred_expire + 1 s) applies and the job still restarts."""
    ex = slurm_cluster.executor(tmp_path / "jobs", ntasks_per_node=1, cpus_per_task=1, timeout_min=30)
    job = ex.submit(requeue_myself_once)
    assert job.result() == 1
    assert slurm_cluster.requeue_count(job.job_id) == 1
    assert _final_state(job) == "COMPLETED"


def test_stop_kills_every_daemon_by_pid(tmp_path_factory, slurm_cluster: SlurmCluster):
    """A second, independent cluster in the same process comes up and goes down cleanly (ports/sockets private)."""
    from tests.slurm_cluster import _pid_alive

    conf_before = os.environ["SLURM_CONF"]
    c = SlurmCluster(tmp_path_factory.mktemp("slurm2"))
    try:
        c.start()
        pids = c.pids()
        assert c.run_cmd("srun", "-n", "1", "true").returncode == 0
    finally:
        c.stop()
    assert not any(_pid_alive(p) for p in pids.values())
    assert os.environ["SLURM_CONF"] == conf_before  # restored to the session cluster's
    c.stop()  # idempotent


_ORPHAN_SCRIPT = """
import json, os, subprocess, sys
sys.path.insert(0, {repo!r})
from tests.slurm_cluster import SlurmCluster
c = SlurmCluster({base!r}).start()
job = c.run_cmd("sbatch", "--parsable", "--wrap", "sleep 300", "-o", os.devnull).stdout.strip()
c.wait_state(job, "RUNNING", timeout=60)
print(json.dumps({{"pids": c.pids(), "sock_dir": str(c.sock_dir)}}), flush=True)
os._exit(0)  # a crashed session: no stop(), daemons and the job are orphaned
"""


def test_stale_cluster_from_a_dead_session_is_killed(slurm_cluster: SlurmCluster, tmp_path):
    """Daemons (and jobs) orphaned by a crashed session are found by their environment marker and killed by PID;
    the running session cluster is left alone."""
    import json
    import sys

    from tests.slurm_cluster import REPO_ROOT, _pid_alive, _scan, kill_stale_daemons

    script = _ORPHAN_SCRIPT.format(repo=str(REPO_ROOT), base=str(tmp_path / "orphan"))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    orphans, sock_dir = info["pids"], Path(info["sock_dir"])
    assert sock_dir.is_dir()
    assert all(_pid_alive(p) for p in orphans.values())
    orphan_jobs = [pid for pid, conf in _scan()[1].items() if conf == str(tmp_path / "orphan" / "etc" / "slurm.conf")]
    assert orphan_jobs, "the orphaned cluster's job process should be visible"

    killed = kill_stale_daemons()
    assert set(orphans.values()) <= set(killed)
    assert set(orphan_jobs) <= set(killed)
    assert not any(_pid_alive(p) for p in list(orphans.values()) + orphan_jobs)
    assert not list((tmp_path / "orphan" / "run").glob("*.pid"))
    assert not sock_dir.exists()
    # the session cluster survived
    assert all(_pid_alive(p) for p in slurm_cluster.pids().values())
    assert slurm_cluster.run_cmd("srun", "-n", "1", "true").returncode == 0


def test_stop_after_failed_start_kills_what_was_started(tmp_path, slurm_cluster: SlurmCluster):
    from tests.slurm_cluster import SlurmStartError, _pid_alive

    conf_before = os.environ["SLURM_CONF"]
    c = SlurmCluster(tmp_path / "broken")

    def boom():
        raise SlurmStartError("simulated slurmdbd failure")

    c._start_slurmdbd = boom  # munged and mariadbd are up by then
    started = {}
    real_spawn = c._spawn

    def spawn(name, argv, log):
        p = real_spawn(name, argv, log)
        started[name] = p.pid
        return p

    c._spawn = spawn
    with pytest.raises(SlurmStartError, match="simulated slurmdbd failure"):
        c.start()
    assert set(started) == {"munged", "mariadbd"}
    assert not any(_pid_alive(p) for p in started.values())
    assert os.environ["SLURM_CONF"] == conf_before
    c.stop()  # safe to call again
