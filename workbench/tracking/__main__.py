"""``python -m workbench.tracking sync <run folder>`` (and ``serve <uri>``, a job's tracking worker)."""

from __future__ import annotations

import sys

from workbench.errors import WorkbenchError
from workbench.tracking.upload import sync
from workbench.tracking.worker import serve


def main(argv: list[str] | None = None) -> int:
    """``python -m workbench.tracking sync <run folder>``: upload what a run spooled while its server was away."""
    import argparse

    if argv is None and sys.argv[1:2] == ["serve"]:  # a job's tracking worker (WorkerStore), not a user command
        serve(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(prog="python -m workbench.tracking")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("sync", help="upload what a run spooled while its tracking server was away")
    command.add_argument("run_folder")
    command.add_argument("--tracking-uri", help="the server's address now, when it moved since the run")
    args = parser.parse_args(argv)
    try:
        count = sync(args.run_folder, args.tracking_uri)
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"synced {count} tracking calls from {args.run_folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
