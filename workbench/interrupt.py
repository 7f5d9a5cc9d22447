"""SIGTERM and SIGINT end a run cleanly: the signal becomes an :class:`Interrupted` exception in the training thread,
so the MLflow run ends KILLED, no checkpoint is left half-written, and the CLI prints one line saying how to resume.

SIGTERM is what ``scancel``, a SLURM time limit and torchrun (when a peer rank dies) send. Inside a submitit task the
signals stay submitit's own: it answers preemption by checkpointing and requeueing the job.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import threading
from typing import Iterator


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal. ``step``: the last completed step, when the trainer knew it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.step: int | None = None


def _raise(signum: int, frame) -> None:
    raise Interrupted(signum)


def ignore_further() -> None:
    """While a run is being ended (its status written, its tracking spooled), a second signal must not cut that short.
    Restored by :func:`signals_interrupt` on the way out."""
    if threading.current_thread() is threading.main_thread() and not os.environ.get("SUBMITIT_EXECUTOR"):
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)


def resume_hint(error: Interrupted, argv: list[str]) -> str:
    """The one line the CLI prints for an interrupted run."""
    from workbench import checkpoint

    where = f" at step {error.step}" if error.step is not None else ""
    output_dir = getattr(error, "output_dir", None)
    if output_dir is None or not checkpoint.list_checkpoints(output_dir):
        return f"interrupted{where} by {error}; no checkpoint was saved yet (set save_steps), so a rerun starts afresh"
    kept = [a for a in argv if not a.startswith(("resume_from_checkpoint=", "output_dir="))]
    command = [*launched_by(), *kept, f"output_dir={output_dir}", "resume_from_checkpoint=latest"]
    return f"interrupted{where} by {error}; resume with: {shlex.join(command)}"


def launched_by() -> list[str]:
    """The command up to and including ``-m workbench``. Under torchrun, its agent (this process's parent) and every
    argument it was given: a checkpoint resumes only at the world size that wrote it, so plain ``python -m workbench``
    would be refused."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ["python", "-m", "workbench"]
    try:
        agent = [a.decode() for a in open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\0") if a]
    except OSError:  # no /proc: the arguments a rank can see for itself
        agent = ["torchrun", f"--nnodes={os.environ.get('GROUP_WORLD_SIZE', 1)}",
                 f"--nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', 1)}", "-m", "workbench"]
    # `python -m torch.distributed.run ARGS -m workbench ...` or `[python] .../torchrun ARGS -m workbench ...`
    end = next((i for i in range(len(agent) - 1) if agent[i:i + 2] == ["-m", "workbench"]), None)
    start = next((i for i, a in enumerate(agent) if os.path.basename(a) == "torchrun"
                  or agent[i - 1:i + 1] in (["-m", "torch.distributed.run"], ["-m", "workbench.torchrun"])), None)
    if end is None or start is None:
        nodes = os.environ.get("GROUP_WORLD_SIZE", "1")  # several nodes: each node's agent reruns with its own rank
        return ["torchrun", *([f"--nnodes={nodes}"] if nodes != "1" else []),
                f"--nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', 1)}", "-m", "workbench"]
    prefix = ["torchrun"] if os.path.basename(agent[start]) == "torchrun" else [agent[0], "-m", agent[start]]
    return [*prefix, *agent[start + 1:end + 2]]


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """While the block runs (in the main thread, outside submitit), SIGTERM and SIGINT raise :class:`Interrupted`."""
    if threading.current_thread() is not threading.main_thread() or os.environ.get("SUBMITIT_EXECUTOR"):
        yield
        return
    previous = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
