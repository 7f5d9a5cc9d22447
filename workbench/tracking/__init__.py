"""Rank-zero MLflow tracking: one run per job, ended FINISHED or FAILED, never left RUNNING; a dead server delays lines,
never steps. One concern per file, each importing only the ones above it in this list:

    uris.py       where a run is tracked (tracking.uri, $MLFLOW_TRACKING_URI, ./mlflow.db) and the pre-run checks
                  that refuse a store which cannot be used, without MLflow; how fast a dead server fails
    redaction.py  what MLflow may see: the config as params, a pinned secure_seed redacted everywhere
    runs.py       how runs are found again: the sweep's parent-run tags and file, the code's git commit
    outbox.py     writes off the training path: the ordered outbox, its background sender, and the spool on disk
                  (stage, write, read, tidy) that holds what it could not send; no MLflow here
    store.py      where MLflow is written: the store's calls in this process, one operation sent with MLflow's
                  client, a fresh SQLite store created once under a lock
    worker.py     the same store in a worker process, off the job's core (``python -m workbench.tracking serve``)
    tracker.py    a job's tracker: NullTracker (every rank but 0), MlflowTracker (one run), make_tracker
    upload.py     a spool uploaded later into its run (``python -m workbench.tracking sync <run folder>``)
    __main__.py   the command line

Every name that was importable from ``workbench.tracking`` before it became a package still is (below), and the
outbox's names too (the old ``workbench.outbox``); code in this package imports each from its own module.
"""

from workbench.tracking.outbox import (RETRY_MAX, RETRY_MIN, SPOOL, Outbox, StoreError, only_new, permanent, read_spool,
                                       spool_dir, stage, tidy, unsent_lines, unstage, write_spool)
from workbench.tracking.redaction import flatten, redacted, scrub
from workbench.tracking.runs import PARENT_TAG, SWEEP_FILE, SWEEP_TAG, git_sha, sweep_parent
from workbench.tracking.store import STORE_CALLS, Store, _retry, init_store, logged_until, send  # noqa: F401 (_retry)
from workbench.tracking.tracker import FLUSH_WAIT, MlflowTracker, NullTracker, end_if_abandoned, make_tracker
from workbench.tracking.upload import sync
from workbench.tracking.uris import (CHECK_TIMEOUT, FAST_FAIL_ENV, URI_SCHEMES, reachable, tracking_uri, ui_command,
                                     ui_link, uri_problem)
from workbench.tracking.worker import RANK_ENV, RANK_ENV_PREFIXES, WorkerStore, prestart, serve

__all__ = ["CHECK_TIMEOUT", "FAST_FAIL_ENV", "FLUSH_WAIT", "PARENT_TAG", "RANK_ENV", "RANK_ENV_PREFIXES", "RETRY_MAX",
           "RETRY_MIN", "SPOOL", "STORE_CALLS", "SWEEP_FILE", "SWEEP_TAG", "URI_SCHEMES", "MlflowTracker",
           "NullTracker", "Outbox", "Store", "StoreError", "WorkerStore", "end_if_abandoned", "flatten", "git_sha",
           "init_store", "logged_until", "main", "make_tracker", "only_new", "permanent", "prestart", "reachable",
           "read_spool", "redacted", "scrub", "send", "serve", "spool_dir", "stage", "sweep_parent", "sync", "tidy",
           "tracking_uri", "ui_command", "ui_link", "unsent_lines", "unstage", "uri_problem", "write_spool"]


def main(argv: list[str] | None = None) -> int:
    """``python -m workbench.tracking sync <run folder>`` (kept as ``workbench.tracking.main``)."""
    from workbench.tracking.__main__ import main as cli

    return cli(argv)
