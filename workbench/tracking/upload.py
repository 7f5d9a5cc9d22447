"""A spool uploaded later: ``python -m workbench.tracking sync <run folder>`` sends what a run spooled while its
server was away into the same run, each metrics line once, and leaves what it could not send spooled for the next
try."""

from __future__ import annotations

import os
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.tracking.outbox import read_spool, spool_dir, tidy, unsent_lines, write_spool
from workbench.tracking.store import logged_until, send
from workbench.tracking.uris import FAST_FAIL_ENV, _creates_store


def sync(output_dir: str | Path, uri: str | None = None) -> int:
    """Upload a run folder's spooled tracking calls into their run (at `uri` when the server moved); returns how many
    were sent."""
    from mlflow import MlflowClient

    spooled = read_spool(output_dir)
    if not spooled:
        raise WorkbenchError(f"{str(output_dir)!r} has nothing spooled (no {spool_dir(output_dir)})")
    for key, value in FAST_FAIL_ENV.items():
        os.environ.setdefault(key, value)
    count, logged = 0, {}  # per run: what it holds, and what this sync sent (spool files may overlap)
    for path, head, ops in spooled:
        head["uri"] = uri or head["uri"]
        if _creates_store(head["uri"]):  # opening it would make an empty store, and the run is not in one
            raise WorkbenchError(f"MLflow run {head['run_id']} is not in {head['uri']}: there is no store there; "
                                 "name the store that holds it with --tracking-uri")
        client = MlflowClient(tracking_uri=head["uri"])
        try:
            until = logged.get((head["uri"], head["run_id"]))
            if until is None:
                until = logged[head["uri"], head["run_id"]] = logged_until(client, head["run_id"])
            for i, op in enumerate(ops):
                if op[0] == "metrics":  # a line that reached the server before the spool was written goes once
                    op = unsent_lines(op, until)
                if op[0] != "metrics" or op[1]:
                    send(client, head["run_id"], op)
                count += 1
        except Exception as e:  # noqa: BLE001 - keep what is left for the next try
            write_spool(output_dir, head["uri"], head["run_id"], ops[i:])
            path.unlink()
            message = " ".join(str(e).split())[:300]
            raise WorkbenchError(f"sync stopped after {count} tracking calls ({head['uri']}: {message}); "
                                 "the rest stays spooled, run sync again") from None
        path.unlink()
    tidy(output_dir)
    return count
