"""How a run is found again among others: the tags that group a sweep's runs under its parent run, the file in a
sweep's folder that names that parent, and the code's git commit that a run records."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

log = logging.getLogger("workbench.tracking")  # the name its lines have always been logged under

PARENT_TAG = "mlflow.parentRunId"
SWEEP_TAG = "workbench.sweep_dir"
SWEEP_FILE = ".workbench-sweep.json"  # in a sweep's folder: its parent run, written by the multirun driver


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent.parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def sweep_parent(sweep_dir: str | Path) -> str | None:
    """The parent run id that the sweep's driver made (see workbench.sweep); None, with a warning, if it made none."""
    import json

    try:
        return json.loads((Path(sweep_dir) / SWEEP_FILE).read_text())["parent_run_id"]
    except (OSError, ValueError, KeyError):
        log.warning("no parent run for sweep folder %s (the multirun driver makes it): this run is not grouped",
                    sweep_dir)
        return None
