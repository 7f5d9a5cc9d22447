"""Where a composed config runs: here (``inline``), on N local processes (``local``), or on SLURM (``slurm``).

The submitting process fixes everything a job needs before submission: the resolved config, one run folder, the Hydra
context (choices, overrides, sweep folder) and the MLflow run. Every rank of the job then runs :func:`workbench.train`
on that same config; nothing is re-composed in the job. On preemption or timeout submitit calls
:meth:`Job.checkpoint`, which requeues the job with ``resume_from_checkpoint=latest_or_new``.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from workbench import checkpoint, config
from workbench.overrides import record_choices
from workbench.errors import WorkbenchError
from workbench.tracking.redaction import scrub
from workbench.world_size import local_gpus, planned_world_size, slurm_tasks_per_node

log = logging.getLogger("workbench")


def hydra_context(cfg: DictConfig) -> None:
    """Record the Hydra choices, overrides and sweep folder in the config itself, so a job (or a resumed one) that has
    no HydraConfig still tags its run and finds its sweep's parent run."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except ValueError:
        return
    overrides = [o for o in hc.overrides.task if not o.startswith(("hydra.", "hydra/"))]
    record_choices(cfg, hc.runtime.choices, overrides)  # "hydra/data" = the data group's choice
    if overrides:
        with open_dict(cfg):
            cfg.tracking.tags.setdefault("overrides", scrub(" ".join(overrides)))
    if hc.mode == RunMode.MULTIRUN and cfg.tracking.sweep_dir is None:
        cfg.tracking.sweep_dir = str(Path(hc.sweep.dir).resolve())


def launch(cfg: DictConfig) -> Any:
    config.validate(cfg)
    from workbench.job import refuse_unsupported  # torch: imported once the config is read
    refuse_unsupported(cfg)
    hydra_context(cfg)
    if cfg.launcher.name == "inline":
        from workbench.run import train
        from workbench.sweep import job_ended

        return train(cfg, on_end=job_ended)
    return submit(cfg)


def _exit_if_reported(result_pickle: Path) -> None:
    """At exit of a task whose result submitit has written: leave without the interpreter's teardown, where torch's
    C++ threads (gloo) can abort the process and turn a COMPLETED task into a FAILED one."""
    if result_pickle.exists():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class Job:
    """What submitit runs on every task: the same trainer on the config fixed at submission. Checkpointable: on
    preemption/timeout it requeues itself to resume from the newest checkpoint of its run folder."""

    def __init__(self, cfg_yaml: str):
        self.cfg_yaml = cfg_yaml

    def __call__(self) -> dict[str, Any]:
        import submitit

        env = submitit.JobEnvironment()
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, env.num_tasks // env.num_nodes))))
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        from workbench.interrupt import Interrupted, resume_hint
        from workbench.run import train
        from workbench.sweep import job_ended

        cfg = OmegaConf.create(self.cfg_yaml)
        _end_on_cancel()
        try:
            result = train(cfg, on_end=job_ended)
        except Interrupted as e:  # scancelled: the run is KILLED already; the job log says how to resume
            if env.global_rank == 0:
                print(resume_hint(e, (cfg.tracking.tags.get("overrides") or "").split()), file=sys.stderr, flush=True)
            logging.shutdown()
            sys.stdout.flush()
            os._exit(128 + e.signum)
        atexit.register(_exit_if_reported, env.paths.result_pickle)
        return {"rank": env.global_rank, "metrics": result.metrics, "epsilon": result.epsilon, "delta": result.delta,
                "steps": result.steps, "run_id": result.run_id, "tracking_uri": result.tracking_uri, "audit": result.audit,
                "output_dir": str(result.output_dir)}

    def checkpoint(self, *args, **kwargs):
        import submitit

        cfg = OmegaConf.create(self.cfg_yaml)
        cfg.resume_from_checkpoint = "latest_or_new"  # preempted before its first checkpoint: starts afresh
        return submitit.helpers.DelayedSubmission(Job(OmegaConf.to_yaml(cfg)))


def _resumed_run(cfg: DictConfig, output_dir: Path) -> str | None:
    """The MLflow run a resumed job continues (its checkpoint's): the submission marks that one, rather than make a
    second run that the job would never use and leave SCHEDULED."""
    if not cfg.resume_from_checkpoint:
        return None
    _, state = checkpoint.load_resumable(cfg.resume_from_checkpoint, output_dir)
    return state.get("run_id") if state else None


def _end_on_cancel() -> None:
    """In a SLURM task submitit ignores SIGTERM ("Bypassing signal SIGTERM"): preemption signals with USR2, which it
    answers by checkpointing and requeueing. But scancel sends SIGTERM alone, then SIGKILL after KillWait, which would
    leave the MLflow run RUNNING forever. So on SIGTERM this task asks SLURM about its job: still RUNNING (submitit's
    preemption, USR2 to follow) -> submitit's way; ending (cancelled, timed out, preempted) -> the run ends as an
    interrupted CLI run does (KILLED, checkpoint whole, the resume hint)."""
    import signal

    job_id = os.environ.get("SLURM_JOB_ID")
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm" or not job_id:
        return
    submitits = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if _slurm_state(job_id) in ("RUNNING", "SUSPENDED"):
            if callable(submitits):
                submitits(signum, frame)
            return
        from workbench.interrupt import Interrupted

        signal.signal(signal.SIGTERM, submitits)  # the run is being ended: a second SIGTERM must not cut that short
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, on_sigterm)


def _slurm_state(job_id: str) -> str | None:
    """JobState as slurmctld has it now (a cancelled job reads COMPLETING or CANCELLED); None if it cannot be asked:
    then the run ends KILLED and resumable rather than stay RUNNING."""
    import re
    import subprocess

    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=3).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"\bJobState=(\S+)", out)
    return found.group(1) if found else None


def _executor(cfg: DictConfig, folder: Path):
    import submitit

    lc = cfg.launcher
    if lc.name == "local":
        nprocs = planned_world_size(cfg)
        executor = submitit.LocalExecutor(folder=str(folder))
        executor.update_parameters(tasks_per_node=nprocs, nodes=1, timeout_min=lc.timeout_min,
                                   gpus_per_node=local_gpus() and nprocs)
        return executor
    if shutil.which("sbatch") is None:
        raise WorkbenchError("launcher=slurm needs SLURM's sbatch on PATH, and there is none on this machine; "
                             "use launcher=local or launcher=inline")
    tasks = slurm_tasks_per_node(lc)
    executor = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=lc.max_num_timeout)
    params: dict[str, Any] = dict(nodes=lc.nodes, ntasks_per_node=tasks, time=lc.timeout_min,
                                  setup=list(lc.setup), additional_parameters=dict(lc.additional_parameters),
                                  job_name=cfg.tracking.experiment_name)
    if lc.gpus_per_node:
        params["gpus_per_node"] = lc.gpus_per_node
    if lc.cpus_per_task:
        params["cpus_per_task"] = lc.cpus_per_task
    if lc.mem_gb:
        params["mem"] = f"{int(lc.mem_gb * 1024)}MB"
    for key in ("partition", "account", "qos", "constraint"):
        if lc.get(key):
            params[key] = lc[key]
    executor.update_parameters(**params)
    return executor


def submit(cfg: DictConfig) -> Any:
    """Submit one job (local processes or SLURM); wait for it and report, or print where it runs and return."""
    from workbench.run import closing_line
    from workbench.tracking.tracker import make_tracker

    output_dir = config.resolve_output_dir(cfg)
    cfg.output_dir = str(output_dir)
    config.check_writable(output_dir)
    checkpoint.check_folder(output_dir, cfg.resume_from_checkpoint)
    executor = _executor(cfg, output_dir / "submitit")
    tracker = make_tracker(cfg, is_main=True)
    problem = tracker.check()
    if problem:
        raise WorkbenchError(problem)
    tracker.start({"launcher": cfg.launcher.name, "status": "submitted", **cfg.tracking.tags},
                  run_id=_resumed_run(cfg, output_dir), sweep_dir=cfg.tracking.sweep_dir, pending=True)
    cfg.tracking.run_id = tracker.run_id
    try:
        job = executor.submit(Job(OmegaConf.to_yaml(cfg, resolve=True)))
    except Exception as e:  # noqa: BLE001 - surface sbatch's own message in one line
        message = f"submission failed: {' '.join(str(e).split())[:400]}"
        tracker.set_tags({"error": message})
        tracker.finish("FAILED")
        raise WorkbenchError(message) from None
    tracker.set_tags({"job_id": job.job_id})
    print(f"submitted job {job.job_id} ({cfg.launcher.name}) run folder {output_dir}"
          + (f" MLflow run {tracker.run_id}" if tracker.run_id else ""), flush=True)
    if not cfg.launcher.wait:
        tracker.flush()  # the job_id tag reaches MLflow (or the spool) before this process leaves
        return job
    try:
        results = job.results()
    except Exception as e:  # noqa: BLE001 - any rank failing fails the launch
        message = f"job {job.job_id} failed (logs in {output_dir / 'submitit'}): {' '.join(str(e).split())[-600:]}"
        tracker.set_tags({"error": message})
        tracker.finish_if_running("FAILED")
        raise WorkbenchError(message) from None
    main = next(r for r in results if r["rank"] == 0)
    print(closing_line(main["metrics"], main["epsilon"], main["delta"], main["steps"], main["run_id"],
                       main["tracking_uri"], job_id=job.job_id, audit=main["audit"],
                       experiment_id=tracker.experiment_id), flush=True)
    tracker.finish_if_running("FINISHED")  # the job ended its run; this sends what the launcher queued, then closes
    return main

