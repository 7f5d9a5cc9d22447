"""Checkpoints: atomic save (temp file + rename), rotation, safe load (weights_only=True), resume lookup."""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from workbench.errors import TrainingStopped, WorkbenchError

PREFIX = "checkpoint-"
_STEP = re.compile(rf"^{PREFIX}(\d+)\.pt$")


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoints under output_dir, oldest step first."""
    return _in_folder(checkpoint_dir(output_dir))


def _in_folder(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP.match(p.name))]
    return [p for _, p in sorted(found)]


def save(state: dict[str, Any], output_dir: str | Path, step: int, save_total_limit: int | None) -> Path:
    """Write checkpoint-<step>.pt atomically; keep only the newest `save_total_limit`."""
    folder = checkpoint_dir(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{PREFIX}{step}.pt"
    tmp = folder / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:  # a file object, so that a full disk is an OSError, not a zip writer's riddle
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        cause = _os_error(e)
        if cause is None:
            raise
        previous = list_checkpoints(output_dir)
        kept = f"; the last good checkpoint is {previous[-1]}" if previous else ""
        # Saving happens only once training began: the run stops (exit 1, run FAILED), it is not bad input (exit 2).
        raise TrainingStopped(f"could not write checkpoint {path}: {cause.strerror or cause}{kept}") from None
    finally:
        tmp.unlink(missing_ok=True)
    if save_total_limit is not None:
        for old in list_checkpoints(output_dir)[:-save_total_limit]:
            old.unlink(missing_ok=True)
    return path


def _os_error(error: BaseException | None) -> OSError | None:
    """The OSError behind a failed write (torch's zip writer reports it as a RuntimeError raised while closing)."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def resolve(resume_from: str, output_dir: str | Path) -> Path | None:
    """`latest` -> newest checkpoint under output_dir, refused when there is none (a mistyped output_dir would
    otherwise start afresh and spend a second privacy budget); `latest_or_new` -> the same, or None (a requeued job
    that may not have saved yet); a path must exist."""
    if resume_from in ("latest", "latest_or_new"):
        found = list_checkpoints(output_dir)
        if not found and resume_from == "latest":
            raise WorkbenchError(f"resume_from_checkpoint=latest: there is no checkpoint in {checkpoint_dir(output_dir)}; "
                                 "check output_dir, or use resume_from_checkpoint=latest_or_new to start afresh when "
                                 "there is none")
        return found[-1] if found else None
    path = Path(resume_from).expanduser()
    if path.is_dir():
        found = list_checkpoints(path) or _in_folder(path)  # a run folder, or its checkpoints/ folder
        if not found:
            raise WorkbenchError(f"resume_from_checkpoint={resume_from!r} is a folder with no checkpoint in it")
        return found[-1]
    if not path.is_file():
        raise WorkbenchError(f"resume_from_checkpoint={resume_from!r} does not exist")
    return path


def check_folder(output_dir: str | Path, resume_from: str | None) -> None:
    """Before any work: a new run never writes over another run's checkpoints, and a resume has something to resume."""
    if resume_from:
        resolve(resume_from, output_dir)
    elif found := list_checkpoints(output_dir):
        raise WorkbenchError(f"output_dir {str(output_dir)!r} already holds another run's checkpoints ({found[-1].name}); "
                             "continue that run with resume_from_checkpoint=latest, or choose another output_dir")


def load(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise WorkbenchError(f"checkpoint {str(path)!r} is truncated or corrupt ({path.stat().st_size} bytes; torch "
                             f"cannot read it: {_first_sentence(e)})") from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise WorkbenchError(f"{str(path)!r} is not a workbench checkpoint (no model/step inside)")
    return state


def _first_sentence(error: BaseException) -> str:
    """torch's reader adds paragraphs of advice; an OSError from a cut-off file says only 'Invalid argument'."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text.split(". ")[0].rstrip(".")


def load_resumable(resume_from: str, output_dir: str | Path) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint a run resumes from, loaded: resolve(), and when that one is truncated or corrupt (a node lost
    mid-copy, a disk that filled) the newest intact one before it, with a warning naming both. Never (None, None) for
    an unreadable one: a run that had checkpoints must not quietly start afresh and spend a second privacy budget."""
    import logging

    path = resolve(resume_from, output_dir)
    if path is None:
        return None, None
    try:
        return path, load(path)
    except WorkbenchError as e:
        broken = str(e)
    for older in reversed([p for p in _in_folder(path.parent) if _step(p) < _step(path)]):
        try:
            state = load(older)
        except WorkbenchError:
            continue
        logging.getLogger("workbench").warning("%s; resuming from the newest intact checkpoint, %s", broken, older)
        return older, state
    raise WorkbenchError(f"{broken}; no intact checkpoint before it in {path.parent} to resume from "
                         "(a fresh start needs another output_dir)")


def _step(path: Path) -> int:
    m = _STEP.match(path.name)
    return int(m.group(1)) if m else -1
