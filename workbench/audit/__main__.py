"""``python -m workbench.audit [hydra overrides]``: train the composed config with ``audit=canaries`` and print the
one-run audit's bound beside the reported epsilon. A command line that runs a job: it sits above the job runner, the
bound it prints is workbench/privacy/auditing/bound.py."""

from __future__ import annotations

import sys
from typing import Sequence

from workbench.api import compose
from workbench.errors import WorkbenchError
from workbench.run import train


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        result = train(compose(["audit=canaries", *args]))
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a = result.audit
    per, what = (" per user", "canary users") if a.unit == "user" else ("", "canaries")
    print(f"audit: epsilon >= {a.epsilon_lower_bound:.3f}{per} ({a.correct}/{a.guesses} correct, {a.observer} observer, "
          f"{a.canaries} {what}, {a.tests} tests at significance {a.significance}); "
          f"{'ideal ' + format(a.ideal_lower_bound, '.3f') if a.ideal_lower_bound is not None else 'no ideal bound'}; "
          f"reported epsilon {result.epsilon if result.epsilon is not None else 'inf (privacy=none)'}{per}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
