"""Signals and dead ranks end runs cleanly: one line, the run KILLED (or FAILED), never left RUNNING, and the newest
checkpoint intact. Real processes: the CLI, torchrun (`python -m torch.distributed.run`) and launcher=local."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import REPO, assert_same_history
from workbench import checkpoint

pytestmark = pytest.mark.slow

# 0.1 s a batch, a line every 2 steps, a checkpoint every 20: long enough to interrupt after the first checkpoint with
# lines logged past it (a resume trains those steps again). A pinned secure_seed: two runs are comparable bit for bit;
# 50 lines: each line's epsilon composed exactly (over EXACT_LINES, a line's value depends on which lines a run logs).
ARGS = ["experiment=quick", "data.train._target_=tests.plugins.SlowSynthetic", "max_steps=100", "save_steps=20",
        "logging_steps=2", "disable_tqdm=true", "privacy.secure_seed=1234"]
TRIALS = 4  # per way a rank dies; with the in-process orderings of tests/test_distributed.py (issue 45)


def _start(tmp_path: Path, *cmd: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WB_FETCH_SLEEP": "0.1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    # WB_TEST_JOB marks this job's processes (submitit's local ranks are not the launcher's children).
    return subprocess.Popen(["sh", "-c", 'WB_TEST_JOB=$$ exec "$@"', "sh", sys.executable, *cmd], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path) -> None:
    deadline = time.monotonic() + 300
    while not checkpoint.list_checkpoints(run_dir):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        if time.monotonic() >= deadline:  # say where the job stood: its own logs and the ranks' (submitit's)
            _kill_group(proc)
            logs = {p.name: p.read_text(errors="replace")[-1500:] for p in run_dir.parent.rglob("*")
                    if p.is_file() and p.suffix in (".err", ".out", ".log")}
            raise AssertionError(f"no checkpoint was written in 300 s; stderr: {proc.communicate()[1][-1500:]}; "
                                 f"logs: {logs}")
        time.sleep(0.2)


def _wait_for_steps_past_a_checkpoint(proc: subprocess.Popen, run_dir: Path) -> None:
    """Wait until the job's lines reach MLflow (its tracking worker is up), then for its next checkpoint, then half a
    second more (about 6 steps of 0.1 s, the next checkpoint 20 steps away): a stop now leaves steps logged past the
    newest checkpoint, which the resume trains again. The test asserts that it did (the step its line names)."""
    _wait_for_checkpoint(proc, run_dir)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.parent / 'mlflow.db'}")
    deadline = time.monotonic() + 120
    while True:
        runs = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
        if runs and client.get_metric_history(runs[0].info.run_id, "learning_rate"):
            break
        assert proc.poll() is None and time.monotonic() < deadline, "no line reached MLflow"
        time.sleep(0.05)
    seen = checkpoint.list_checkpoints(run_dir)[-1]
    while checkpoint.list_checkpoints(run_dir)[-1] == seen:
        assert proc.poll() is None and time.monotonic() < deadline, "no further checkpoint"
        time.sleep(0.02)
    time.sleep(0.6)


def _resume_and_compare(tmp_path: Path, command: str, whole: tuple[str, str]) -> None:
    """Run the printed resume command (at full speed: the same numbers) to the end; the run's whole metric history
    then equals the uninterrupted run's `whole` (uri, run_id)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    resumed = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr and _statuses(tmp_path) == ["FINISHED"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    assert_same_history(f"sqlite:///{tmp_path / 'mlflow.db'}", run.info.run_id, whole[1], whole[0])


_WHOLE: dict[str, tuple[str, str]] = {}


def _whole(tmp_path_factory, *launcher: str) -> tuple[str, str]:
    """An uninterrupted run of ARGS under `launcher` (uri, run_id), made once per session."""
    key = " ".join(launcher)
    if key not in _WHOLE:
        folder = tmp_path_factory.mktemp("whole")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}"}
        done = subprocess.run([sys.executable, *launcher, "-m", "workbench", *ARGS, f"output_dir={folder / 'run'}"],
                              cwd=folder, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
        (run,) = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
        _WHOLE[key] = (env["MLFLOW_TRACKING_URI"], run.info.run_id)
    return _WHOLE[key]


def _statuses(tmp_path: Path) -> list[str]:
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    return [r.info.status for r in client.search_runs([client.get_experiment_by_name("workbench").experiment_id])]


def _rank_pids(launcher: subprocess.Popen, rank_var: str = "RANK") -> dict[int, int]:
    """The rank processes a launcher (torchrun, submitit's local executor) started, by rank (from their environment)."""
    deadline = time.monotonic() + 120
    while True:
        found = {}
        for child in [p.name for p in Path("/proc").iterdir() if p.name.isdigit()]:
            try:
                env = dict(kv.split("=", 1) for kv in Path(f"/proc/{child}/environ").read_text().split("\0") if "=" in kv)
                if env.get("WB_TEST_JOB") != str(launcher.pid):  # not one of this test's processes
                    continue
            except OSError:  # ProcessLookupError included: a process that just ended
                continue
            if rank_var in env:
                found[int(env[rank_var])] = int(child)
        if len(found) == 2:
            return found
        assert time.monotonic() < deadline, "the launcher did not start two ranks"
        time.sleep(0.2)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_the_run_killed_with_one_line(tmp_path, tmp_path_factory, signum):
    """...and the printed command resumes it: each step the interrupted job logged past its checkpoint is trained
    again but logged once, the run's history that of an uninterrupted run (issue 45)."""
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, "-m", "workbench", *ARGS, f"output_dir={run_dir}")
    try:
        _wait_for_steps_past_a_checkpoint(proc, run_dir)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted at step ") and f"output_dir={run_dir} resume_from_checkpoint=latest" in last
    assert _statuses(tmp_path) == ["KILLED"]
    newest = checkpoint.list_checkpoints(run_dir)[-1]
    assert checkpoint.load(newest)["step"] == int(newest.stem.split("-")[1])  # whole and readable
    assert not list(run_dir.rglob(".*tmp*"))
    assert int(last.split()[3]) >= checkpoint.load(newest)["step"] + 2  # a line logged that the resume trains again
    import re

    _resume_and_compare(tmp_path, re.search(r"; resume with: (.*)$", last).group(1).replace("python", sys.executable, 1),
                        _whole(tmp_path_factory))


def _kill_group(proc: subprocess.Popen) -> None:
    """Leave nothing running, whatever the test saw."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _torchrun(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    return _start(tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",  # standalone: a port bound when chosen
                  "-m", "workbench", *ARGS, f"output_dir={run_dir}"), run_dir


@pytest.mark.parametrize("trial", range(TRIALS))
@pytest.mark.parametrize("rank, signum", [(1, signal.SIGTERM), (0, signal.SIGKILL), (1, signal.SIGKILL)])
def test_a_signalled_or_dead_rank_leaves_the_run_failed(tmp_path, rank, signum, trial):
    """Whichever the survivor sees first, its dead peer's collective error or the SIGTERM torchrun then sends it,
    the run ends FAILED: the first cause (issue 45)."""
    proc, run_dir = _torchrun(tmp_path)
    try:
        _wait_for_checkpoint(proc, run_dir)
        os.kill(_rank_pids(proc)[rank], signum)
        proc.communicate(timeout=180)
    finally:
        _kill_group(proc)
    assert proc.returncode != 0
    assert _statuses(tmp_path) == ["FAILED"]
    newest = checkpoint.list_checkpoints(run_dir)[-1]
    assert checkpoint.load(newest)["step"] == int(newest.stem.split("-")[1])


def test_sigterm_to_the_torchrun_job_ends_the_run_killed(tmp_path):
    proc, run_dir = _torchrun(tmp_path)
    try:
        _wait_for_checkpoint(proc, run_dir)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=180)
    finally:
        _kill_group(proc)
    assert proc.returncode != 0
    assert _statuses(tmp_path) == ["KILLED"]


def test_local_launcher_rank_zero_killed_leaves_the_run_failed(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, "-m", "workbench", *ARGS, "launcher=local", "launcher.nprocs=2", f"output_dir={run_dir}")
    try:
        _wait_for_checkpoint(proc, run_dir)
        os.kill(_rank_pids(proc, "SUBMITIT_LOCAL_GLOBALID")[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
    finally:
        _kill_group(proc)
    assert proc.returncode == 2 and "failed" in err.strip().splitlines()[-1]
    assert _statuses(tmp_path) == ["FAILED"]


@pytest.mark.parametrize("torchrun", ["torch.distributed.run", "workbench.torchrun"])
def test_a_torchrun_job_stopped_by_sigterm_prints_the_torchrun_command_that_resumes_it(tmp_path, tmp_path_factory,
                                                                                       torchrun):
    """The hint names torchrun and its arguments (a checkpoint written by 2 ranks is refused by `python -m workbench`,
    1 rank); run as printed, it resumes the same MLflow run to the end. Stock torchrun then adds its own traceback and
    exits 1; `python -m workbench.torchrun` (the same agent) ends with the one line and 128 + SIGTERM."""
    import re
    import shlex

    run_dir = tmp_path / "run"
    proc = _start(tmp_path, "-m", torchrun, "--standalone", "--nproc-per-node=2", "-m", "workbench",
                  *ARGS, f"output_dir={run_dir}")
    try:
        _wait_for_steps_past_a_checkpoint(proc, run_dir)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        _kill_group(proc)
    hints = [line for line in err.splitlines() if line.startswith("interrupted at step ")]
    assert len(hints) == 1, err[-3000:]  # one line for the job, not one per rank
    command = re.search(r"; resume with: (.*)$", hints[0]).group(1)
    assert command.startswith(f"{shlex.quote(sys.executable)} -m {torchrun} --standalone --nproc-per-node=2 "
                              "-m workbench "), command
    if torchrun == "workbench.torchrun":  # as README promises: the one line, the shell's code for the signal
        assert proc.returncode == 128 + signal.SIGTERM and err.strip().splitlines() == hints, err[-3000:]
    else:  # stock torchrun's own ending, documented in README
        assert proc.returncode == 1 and "SignalException" in err
    assert command.endswith(f"output_dir={run_dir} resume_from_checkpoint=latest")
    assert _statuses(tmp_path) == ["KILLED"]

    _resume_and_compare(tmp_path, command, _whole(tmp_path_factory, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc-per-node=2"))
    assert checkpoint.load(checkpoint.list_checkpoints(run_dir)[-1])["step"] == 100


@pytest.mark.parametrize("nodes, expected", [("1", ["torchrun", "--nproc-per-node=2", "-m", "workbench"]),
                                             ("2", ["torchrun", "--nnodes=2", "--nproc-per-node=2", "-m", "workbench"])])
def test_the_resume_hint_under_an_agent_it_cannot_read_keeps_the_node_count(monkeypatch, nodes, expected):
    """When the agent's own command line names no torchrun (a wrapper started it), the hint is rebuilt from the
    rank's environment: a multi-node job's hint keeps --nnodes, or a rerun would start a one-node job."""
    from workbench.interrupt import launched_by

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("GROUP_WORLD_SIZE", nodes)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(os, "getppid", os.getpid)  # this pytest process: no torchrun in its command line
    assert launched_by() == expected
