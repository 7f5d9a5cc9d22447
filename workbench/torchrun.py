"""``python -m workbench.torchrun [torchrun's options] -m workbench [overrides]``: torchrun, ending as the workbench does.

Stock ``torchrun`` answers SIGTERM or Ctrl-C by stopping its ranks (each ends the MLflow run KILLED, rank 0 prints the
one line that says how to resume), then raises its own SignalException: some 30 lines of traceback after that line,
and exit 1. This is the same torchrun (same options, same agent) that ends with the workbench's line alone and the
shell's code for the signal, 128 + its number, as README promises for every launcher. A refusal (bad input, every
rank exits 2, rank 0 prints its one line) ends it with that line alone and exit 2, where stock torchrun exits 1 after
its ChildFailedError report (some 40 lines).
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent's own notes on a stop ("Received 15 death signal", "Sending process ... SIGTERM") and on a failed rank
    # ("failed (exitcode: 2) local_rank: 0 ..."): the ranks say it, and so does the line below.
    # torch sets each of its elastic loggers' level itself ($LOGLEVEL, default WARNING), so each is quietened here.
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:  # a rank failed: it printed its own error; name it in one line
        rank, failure = e.get_first_failure()
        if failure.exitcode == 2:  # refused: rank 0's one error: line said why (workbench/__main__.py), exit 2 as it
            return 2
        print(f"error: rank {rank} exited with code {failure.exitcode} (its output is above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
