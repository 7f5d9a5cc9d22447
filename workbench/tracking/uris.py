"""Where a run is tracked and whether that store can be used, found before any work and without MLflow: the URI
policy (tracking.uri, else $MLFLOW_TRACKING_URI, else ./mlflow.db), its pre-run checks, and how fast a dead server
fails."""

from __future__ import annotations

import os
from pathlib import Path

# MLflow's HTTP client retries each call for minutes by default; our outbox retries instead, in the background, so
# one call against a dead server fails within seconds. A user's own setting wins.
FAST_FAIL_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
CHECK_TIMEOUT = 10.0  # seconds: an unreachable store is refused within this, before any work
URI_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc", "file")


def tracking_uri(configured: str | None) -> str:
    """tracking.uri, else $MLFLOW_TRACKING_URI, else SQLite in the working directory (MLflow 3.13+ refuses ./mlruns)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


# MLflow 3.17's UI shows an experiment in its GenAI view unless told otherwise: it picks the view by this query
# parameter (the sidebar's toggle writes it), not by the experiment's mlflow.experimentKind tag.
TRAINING_VIEW = "workflowType=machine_learning"
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
# The experiment's runs table as workbench shows it (epsilon, delta and the eval metrics as its first columns): a view
# MLflow's UI loads from the experiment tag mlflow.sharedViewState.<key> (workbench/tracking/runs.py writes it).
TABLE_VIEW = "workbench"


def ui_link(uri: str, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """The page of a run (else its experiment's runs table, else the experiments) in MLflow's training view: on the
    server at `uri`, or on `mlflow ui` started locally for any other store."""
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else LOCAL_UI
    if experiment_id and run_id:
        return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?{TRAINING_VIEW}"
    if experiment_id:
        return f"{base}/#/experiments/{experiment_id}/runs?viewStateShareKey={TABLE_VIEW}&{TRAINING_VIEW}"
    return f"{base}/#/experiments?{TRAINING_VIEW}"


def ui_command(uri: str, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """How to look at a run: open its link, after starting `mlflow ui` on the store when it is not a server."""
    link = ui_link(uri, experiment_id, run_id)
    if uri.startswith(("http://", "https://")):
        return f"open {link}"
    return f"mlflow ui --backend-store-uri {uri}, then open {link}"


def uri_problem(uri: str) -> str | None:
    """Why MLflow cannot use `uri`, found without contacting it; None when it looks usable."""
    from urllib.parse import urlparse

    try:
        parsed = urlparse(uri)
    except ValueError as e:
        return f"tracking.uri={uri!r} is not a URI ({e})"
    scheme = parsed.scheme.split("+")[0]
    if scheme not in URI_SCHEMES:
        return (f"tracking.uri={uri!r} is not a tracking URI MLflow can use; give sqlite:///<path>/mlflow.db or "
                "http(s)://<host>:<port>")
    if scheme == "sqlite" and uri != "sqlite://":  # sqlite:///<path>; MLflow would create a mistyped folder
        folder = Path(uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else parsed.path).parent
        if not folder.is_dir():
            return f"tracking.uri={uri!r}: the folder {str(folder)!r} does not exist; create it or fix the path"
    return None


def _creates_store(uri: str) -> bool:
    """Whether opening `uri` would create its SQLite file: a job refused by its pre-run checks must leave none."""
    return uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists()


def reachable(uri: str) -> str | None:
    """Why a server at `uri` cannot be reached (one line), found by a TCP connection within CHECK_TIMEOUT seconds and
    without MLflow; None for a reachable server and for stores that are not servers (SQLite: a path, checked by
    uri_problem)."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return None
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        with socket.create_connection((parsed.hostname or "localhost", port), timeout=CHECK_TIMEOUT):
            return None
    except socket.timeout:
        return f"tracking.uri={uri!r} did not answer within {CHECK_TIMEOUT:.0f} s"
    except (OSError, ValueError) as e:
        reason = f"[Errno {e.errno}] {e.strerror}" if getattr(e, "errno", None) else str(e)
        return f"tracking.uri={uri!r} cannot be used: {reason}"
