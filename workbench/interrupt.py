"""SIGTERM and SIGINT end a run cleanly: the signal becomes an :class:`Interrupted` exception in the training thread,
so the MLflow run ends KILLED, no checkpoint is left half-written, and the CLI prints one line saying how to resume.

SIGTERM is what ``scancel``, a SLURM time limit and torchrun (when a peer rank dies) send. Inside a submitit task the
signals stay submitit's own: it answers preemption by checkpointing and requeueing the job.

In a job of several ranks the first cause decides how the run ends (:func:`outcome`): KILLED when the whole job was
stopped (every rank got the signal), FAILED when a rank failed or died first, even if the signal torchrun then sends
the survivors reaches a survivor before the dead peer's collective error does.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shlex
import signal
import threading
import time
from typing import Iterator

GRACE = 3.0  # seconds a signalled rank waits for its peers' signal (a stop of the whole job reaches all within ms)
REFUSAL_WAIT = 10.0  # seconds a rank > 0 that refused waits for rank 0's refusal (the same checks, moments apart)


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


class Peers:
    """What this rank tells the job's other ranks about how it stops, through the process group's store (torchrun's
    agent holds it, so it outlives a dead rank): two counters, ranks signalled and ranks failed, each rank counted once.
    A signal is counted the moment it arrives (a thread woken by the signal's wakeup fd, see signals_interrupt), even
    while the training thread is blocked in a collective and cannot run the Python handler yet."""

    def __init__(self, store=None, world_size: int = 1, rank: int = 0):
        self.store, self.world_size = (store, world_size) if world_size > 1 else (None, 1)
        self.rank = rank
        self.signum: int | None = None
        self._counted: set[str] = set()
        self._lock = threading.Lock()

    def count(self, what: str) -> None:
        with self._lock:
            if self.store is not None and what not in self._counted:
                self._counted.add(what)
                self.store.add(f"workbench.stop.{what}", 1)

    def read(self, what: str) -> int:
        return self.store.add(f"workbench.stop.{what}", 0)

    def signalled(self, signum: int) -> None:
        self.signum = self.signum or signum
        try:
            self.count("signalled")
        except Exception:  # noqa: BLE001 - a store that is gone: outcome() finds it so
            pass

    def outcome(self, error: BaseException) -> str:
        """How a run that ends with `error` ends: KILLED or FAILED. The first cause wins. Alone, a signal is KILLED
        and anything else FAILED. In a job of several ranks, a rank that failed unsignalled says so and ends FAILED; a
        signalled one waits up to GRACE seconds and ends KILLED only when every rank was signalled and none had
        failed. A peer that failed, died (it is never counted) or was stopped alone (torchrun then stops the others)
        makes the run FAILED on every rank, whichever of the dead peer's collective error and torchrun's SIGTERM
        reaches a survivor first."""
        if self.store is None:
            return "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        try:
            if not (isinstance(error, KeyboardInterrupt) or self.signum is not None):
                self.count("failed")
                return "FAILED"
            self.signalled(getattr(error, "signum", signal.SIGINT))
            deadline = time.monotonic() + GRACE
            while self.read("failed") == 0:
                if self.read("signalled") >= self.world_size:  # the whole job was stopped
                    return "KILLED"
                if time.monotonic() > deadline:  # stopped alone, or a peer is dead: the job failed
                    self.count("failed")
                    return "FAILED"
                time.sleep(0.05)
            return "FAILED"
        except Exception:  # noqa: BLE001 - the store is gone, with the peer that held it
            return "FAILED"

    def refused_alike(self, error: BaseException) -> bool:
        """Whether rank 0 refused with the same line as this rank's `error` (rank 0 tells, the others ask): then only
        rank 0 says it (workbench/__main__.py). A refusal only this rank hit (its shard's data, say) is not, and this
        rank says it itself, so that nothing is lost."""
        if self.store is None:
            return False
        try:
            if self.rank == 0:
                self.store.set("refused", str(error))
                return True
            self.store.wait(["refused"], datetime.timedelta(seconds=REFUSAL_WAIT))
            return self.store.get("refused").decode() == str(error)
        except Exception:  # noqa: BLE001 - rank 0 did not refuse (in time), or the store is gone
            return False

    def as_interrupted(self, error: BaseException) -> BaseException:
        """For a run that ends KILLED: a rank whose own error is the collective a stopped peer left (its signal's
        handler had not run yet) reports the stop (the CLI's line that says how to resume)."""
        if isinstance(error, KeyboardInterrupt) or self.signum is None:
            return error
        stopped = Interrupted(self.signum)
        stopped.__cause__ = error
        return stopped


_peers = Peers()


def join(store, world_size: int, rank: int = 0, run_key: str = "") -> Peers:
    """Once the process group exists: this rank's stop is told to its `world_size - 1` peers through `store`, under
    `run_key` (one per run, from rank 0: torchrun's store outlives a run, and a later run in the same job, a sweep's
    next point, must not read this one's counts). Returns this job's :class:`Peers` (its outcome() and
    as_interrupted() say how the run ends)."""
    global _peers
    if store is not None and run_key:
        from torch.distributed import PrefixStore

        store = PrefixStore(f"workbench.run.{run_key}.", store)
    signum, _peers = _peers.signum, Peers(store, world_size, rank)
    if signum is not None:  # a signal that came while the group was being made
        _peers.signalled(signum)
    return _peers


_wakeup_fd = -1  # signals_interrupt's pipe, while it is installed


def _forget_wakeup_fd_in_child() -> None:
    """A forked child (a DataLoader worker) inherits the wakeup fd: a signal only it got would count as this rank's."""
    if _wakeup_fd >= 0:
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:  # forked from another thread than the main one: not the main thread in the child either
            pass


os.register_at_fork(after_in_child=_forget_wakeup_fd_in_child)


def _watch(read_fd: int, previous_fd: int) -> None:
    while data := os.read(read_fd, 64):
        if previous_fd >= 0:  # an event loop's own wakeup fd (asyncio's signal handlers) still hears every signal
            try:
                os.write(previous_fd, data.replace(b"\0", b""))
            except OSError:
                pass
        for signum in data:
            if signum == 0:  # signals_interrupt is done
                return
            if signum in (signal.SIGTERM, signal.SIGINT):
                _peers.signalled(signum)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """While the block runs (in the main thread), SIGTERM and SIGINT raise :class:`Interrupted`, and each is counted
    for the job's other ranks as it arrives (see :class:`Peers`). Inside a submitit task the handlers stay submitit's
    own (launch.py's scancel handler raises Interrupted where the job is ending), but the signals are still counted as
    they arrive: a scancel stops every task, and one blocked in a collective whose handler has not run yet must not
    read its peer's leaving as a failure."""
    global _peers, _wakeup_fd
    _peers = Peers()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    _wakeup_fd = write_fd
    watcher = threading.Thread(target=_watch, args=(read_fd, previous_fd), name="workbench-signals", daemon=True)
    watcher.start()
    previous = {} if os.environ.get("SUBMITIT_EXECUTOR") else \
        {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(previous_fd)
        _wakeup_fd = -1
        os.write(write_fd, b"\0")  # the watcher stops
        watcher.join()
        os.close(write_fd)
        os.close(read_fd)
