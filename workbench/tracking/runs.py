"""How a run is found again among others: the tags that group a sweep's runs under its parent run, the file in a
sweep's folder that names that parent, the code's git commit that a run records, and MLflow's own tags (source, user,
commit, the experiment's kind) by which its UI files and shows a run."""

from __future__ import annotations

import getpass
import json
import logging
import subprocess
import sys
from pathlib import Path

from workbench.tracking.uris import TABLE_VIEW

log = logging.getLogger("workbench.tracking")  # the name its lines have always been logged under

PARENT_TAG = "mlflow.parentRunId"
SWEEP_TAG = "workbench.sweep_dir"
SWEEP_FILE = ".workbench-sweep.json"  # in a sweep's folder: its parent run, written by the multirun driver
# MLflow 3's UI opens an experiment by its kind: without one it shows the GenAI overview and files runs under
# "Evaluation runs"; this kind opens the model-training view (the values are MLflow's ExperimentKind in its UI code).
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
NOTE_TAG = "mlflow.note.content"  # the run's description in MLflow's UI: the job's closing line
# MLflow's runs table shows no metric until a user picks its columns; a shared view (an experiment tag its UI loads by
# the link's viewStateShareKey, workbench/tracking/uris.py) shows the privacy budget and the eval metrics first.
_COLUMNS = [*(f"metrics.`{m}`" for m in ("epsilon", "delta", "eval_accuracy", "eval_loss")),
            *(f"attributes.`{a}`" for a in ("Dataset", "Models", "Source"))]
TABLE_VIEW_TAG = f"mlflow.sharedViewState.{TABLE_VIEW}"
TABLE_VIEW_STATE = json.dumps({"selectedColumns": _COLUMNS, "columnOrder": _COLUMNS})


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent.parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def source_tags(launcher: str = "inline", commit: str | None = None) -> dict[str, str]:
    """MLflow's standard tags for a run started by this process, as ``mlflow.start_run`` would set them: what ran
    (``python -m workbench``, or the script), how (LOCAL in this process, JOB from a launcher), the commit and who."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    name = "python -m workbench" if Path(argv0).parts[-2:] == ("workbench", "__main__.py") else argv0
    tags = {"mlflow.source.name": name, "mlflow.source.type": "LOCAL" if launcher == "inline" else "JOB"}
    if commit:
        tags["mlflow.source.git.commit"] = commit
    try:
        tags["mlflow.user"] = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in this environment (a container without one): no tag
        pass
    return tags


def sweep_parent(sweep_dir: str | Path) -> str | None:
    """The parent run id that the sweep's driver made (see workbench.sweep); None, with a warning, if it made none."""
    import json

    try:
        return json.loads((Path(sweep_dir) / SWEEP_FILE).read_text())["parent_run_id"]
    except (OSError, ValueError, KeyError):
        log.warning("no parent run for sweep folder %s (the multirun driver makes it): this run is not grouped",
                    sweep_dir)
        return None
