"""Tracking calls off the training path: an ordered outbox sent by a background thread, and a spool on disk.

Every MLflow write of a run (metrics, params, tags, artifacts, the final status) is an *operation* put in the
:class:`Outbox`. One thread sends them in order; when the server is slow or gone it retries the oldest with backoff,
so a dead server delays lines, never steps, and never reorders them. What is still unsent when the run ends is written
to the run folder's spool (``tracking-spool/``) and uploaded later into the same run by
``python -m workbench.tracking sync <run folder>``.

An operation is a JSON-able tuple: ``("metrics", [[{name: value}, step, ms], ...])``, ``("params", {k: v})``,
``("tags", {k: v})``, ``("artifact", staged_file, artifact_path)``, ``("curves", file_name, data, plot)`` (a figure of
workbench.plots, ``FIGURES[plot](**data)``, drawn where it is sent: matplotlib stays out of the training process),
``("model", staged_file, {name, step, privacy, register})`` (a pickled module, logged as an MLflow model),
``("dataset", {name, digest, source, num_examples, features, context})`` (a run input, from metadata only),
``("system_metrics", interval)`` (start MLflow's sampler where the store runs), ``("status", "FINISHED"|"FAILED"|"KILLED")``.

MLflow is not imported here: operations are written to it by :mod:`workbench.tracking.store` (in this process or in
the worker process of :mod:`workbench.tracking.worker`), and a spool is uploaded by :mod:`workbench.tracking.upload`.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

log = logging.getLogger("workbench.outbox")  # the name its lines have always been logged under

SPOOL = "tracking-spool"
RETRY_MIN, RETRY_MAX = 0.5, 5.0  # seconds between two tries of the oldest operation


def spool_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / SPOOL


class StoreError(Exception):
    """A tracking store's failure as one line, with the HTTP status MLflow gave it (None: no answer, or not HTTP).
    Plain, so that it crosses from the tracking worker process (workbench.tracking.worker) without importing MLflow
    here."""

    def __init__(self, message: str, http_status: int | None = None):
        super().__init__(message)
        self.http_status = http_status

    def __reduce__(self):
        return StoreError, (str(self), self.http_status)


def permanent(error: BaseException) -> bool:
    """A request the server understood and refused (bad value, no such run): retrying cannot help."""
    status = getattr(error, "http_status", None)
    return isinstance(error, StoreError) and status is not None and 400 <= status < 500 and status != 429


class Outbox:
    """Operations sent in order by one background thread; :meth:`put` never blocks, :meth:`drain` waits at most
    its timeout, and nothing here can deadlock: every wait has a timeout or a condition the sender always signals."""

    def __init__(self, send: Callable[[tuple], None]):
        self._send = send
        self._ops: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._sent = 0  # operations sent so far: drain's sign of progress
        self.last_error: str | None = None  # the newest failure, one line; None once a send succeeds again
        self._thread = threading.Thread(target=self._work, name="workbench-tracking-outbox", daemon=True)
        self._thread.start()

    def put(self, op: tuple) -> None:
        with self._cond:
            self._ops.append(op)
            self._cond.notify_all()

    def _work(self) -> None:
        delay = RETRY_MIN
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._ops or self._closed)
                if self._closed:
                    return
                op = self._ops[0]
            try:
                self._send(op)
                sent = True
            except Exception as e:  # noqa: BLE001 - a tracking failure must never reach the training thread
                sent = permanent(e)
                message = " ".join(str(e).split())[:300] or type(e).__name__
                if sent:
                    log.warning("tracking dropped a %s call the server refused: %s", op[0], message)
                else:
                    self.last_error = message
            with self._cond:
                if sent:
                    if self._ops and self._ops[0] is op:
                        self._ops.popleft()
                        self._sent += 1
                    self.last_error, delay = None, RETRY_MIN
                    self._cond.notify_all()
                else:  # the server is away: try the same operation again later (close() cuts the wait short)
                    self._cond.wait(delay)
                    delay = min(2 * delay, RETRY_MAX)

    def drain(self, timeout: float, stalled: bool = False) -> bool:
        """Wait until every operation is sent, at most `timeout` seconds; True when none is left. ``stalled``: the
        `timeout` is counted from the last operation sent instead, so a store that is slow but answering (a loaded
        machine, a large model upload) is waited for, and only one that stopped answering is given up on."""
        with self._cond:
            while True:
                sent = self._sent
                woke = self._cond.wait_for(lambda: not self._ops or self._closed or (stalled and self._sent != sent),
                                           timeout)
                if woke and self._ops and not self._closed:
                    continue  # progress (stalled only): wait another `timeout` for the next one
                return not self._ops

    def pending(self) -> list[tuple]:
        """What is not sent yet, oldest first."""
        with self._cond:
            return list(self._ops)

    def close(self, timeout: float = 15.0) -> list[tuple]:
        """Stop sending; returns what was not sent, oldest first. An operation in flight gets `timeout` seconds to
        finish (MLflow's own HTTP timeout bounds it) so that it is not returned as unsent as well."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            return list(self._ops)


def stage(output_dir: str | Path, source: str | Path, artifact_path: str | None) -> tuple:
    """Copy a file into the spool (its source may be a temporary file) and return the artifact operation."""
    folder = spool_dir(output_dir) / "files" / f"{os.getpid()}-{time.monotonic_ns()}"
    folder.mkdir(parents=True, exist_ok=True)
    staged = folder / Path(source).name
    shutil.copyfile(source, staged)
    return ("artifact", str(staged), artifact_path)


def unstage(op: tuple) -> None:
    """Remove an uploaded artifact's (or model's) staged copy (and its folder once empty)."""
    if op[0] in ("artifact", "model"):
        staged = Path(op[1])
        staged.unlink(missing_ok=True)
        try:
            staged.parent.rmdir()
        except OSError:
            pass


def tidy(output_dir: str | Path) -> None:
    """Remove the spool's folders once nothing is left in them."""
    folder = spool_dir(output_dir)
    for sub in sorted(folder.glob("files/*"), reverse=True) + [folder / "files", folder]:
        try:
            sub.rmdir()
        except OSError:
            pass


def write_spool(output_dir: str | Path, uri: str, run_id: str, ops: Iterable[tuple]) -> Path:
    """Append unsent operations to a new spool file in the run folder (written whole, then renamed into place)."""
    folder = spool_dir(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ops-{time.time_ns()}-{os.getpid()}.jsonl"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"uri": uri, "run_id": run_id}) + "\n")
        for op in ops:
            f.write(json.dumps(op) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_spool(output_dir: str | Path) -> list[tuple[Path, dict[str, Any], list[tuple]]]:
    """Every spool file of a run folder, oldest first: (file, {uri, run_id}, operations)."""
    out = []
    for path in sorted(spool_dir(output_dir).glob("ops-*.jsonl")):
        lines = path.read_text().splitlines()
        out.append((path, json.loads(lines[0]), [tuple(json.loads(line)) for line in lines[1:] if line]))
    return out


def only_new(lines, logged: dict[str, int]) -> list:
    """Each line without the metrics already logged at its step or a later one, recording what it logs in `logged`
    (metric name -> newest step logged). Keyed on what every line carries, its step and the names it sends, whatever a
    run publishes (a private run has no loss): a resumed run recomputes the steps after its checkpoint, a replayed
    spool repeats what the server may have taken, and each (metric, step) reaches MLflow once. A line without a step
    is sent as it is."""
    fresh = []
    for metrics, step in lines:
        if step is None:
            fresh.append((metrics, step))
            continue
        new = {k: v for k, v in metrics.items() if step > logged.get(k, -1)}
        if new:
            logged.update(dict.fromkeys(new, step))
            fresh.append((new, step))
    return fresh


def unsent_lines(op: tuple, logged: dict[str, int]) -> tuple:
    """A spooled metrics operation without what is logged already (recorded in `logged` as only_new does)."""
    return ("metrics", [[new, step, ms] for metrics, step, ms in op[1] for new, _ in only_new([(metrics, step)], logged)])
