"""What logging often costs a long run (issue 24): the epsilon on every logged line is a PLD composition.

    python -m benchmarks.logging_cost [--quick] [--steps N] [--repeats R]   # writes its json and markdown
                                                                           # next to this script (not --quick)

The default job (digits, MLP, DP-SGD at epsilon 8, tracking off) for ``--steps`` steps (3000; quick: 1000), run
four ways side by side, interleaved, each repeat from an empty epsilon cache (a rerun would read its schedule back):
- ``sparse``: ``logging_steps=1000`` (a handful of compositions: the floor);
- ``dense``: ``logging_steps=10``, the default, with today's schedule (the last line first, composed at
  ``EXACT_LINES`` lines, those before the last on the coarsest PLD grid within 0.5 % of the run's;
  workbench/privacy/accounting/accountant.py);
- ``dense_fine_lines``: the same, every composed line on the run's own PLD grid (the schedule before the coarse grid);
- ``dense_every_line_exact``: every line composed on the run's grid (the schedule before that).
The rows are the median ratios of each to ``sparse``, in wall time of ``train()`` and in the process's CPU time (all
threads: the schedule's thread included; steadier than wall time on a shared machine). Ratios, not seconds.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("sparse", "dense", "dense_fine_lines", "dense_every_line_exact")


def _run(mode: str, steps: int, seed: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process) of one train()."""
    import resource

    from workbench import compose, train
    from workbench.privacy.accounting import accountant

    every = 1000 if mode == "sparse" else 10
    exact, lines = accountant.exact_steps, accountant.EpsilonSchedule.lines_accountant
    if mode != "dense":  # the older schedules: every composed line on the run's own grid
        accountant.EpsilonSchedule.lines_accountant = lambda self, last: self.accountant
    if mode == "dense_every_line_exact":
        accountant.exact_steps = lambda lines, n=None: list(lines)
    try:
        with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(io.StringIO()):
            os.environ["WORKBENCH_CACHE_DIR"] = cache
            cpu, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            train(compose([f"max_steps={steps}", f"logging_steps={every}", "tracking.enabled=false",
                           "disable_tqdm=true", f"seed={seed}", f"output_dir={cache}/run"]))
            wall, end = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
            return wall, (end.ru_utime - cpu.ru_utime) + (end.ru_stime - cpu.ru_stime)
    finally:
        accountant.exact_steps, accountant.EpsilonSchedule.lines_accountant = exact, lines


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    steps = args.steps or (1000 if args.quick else 3000)
    repeats = args.repeats or (1 if args.quick else 2)
    _run("sparse", 20, 99)  # untimed: the first train() of a process pays its one-time imports and caches
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for r in range(repeats):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):  # interleaved, the order alternating
            times[mode].append(_run(mode, steps, r))
            print(f"{mode}: {times[mode][-1][0]:.1f} s wall, {times[mode][-1][1]:.1f} s CPU", flush=True)
    ratios = {m: {kind: statistics.median(a[i] / b[i] for a, b in zip(times[m], times["sparse"]))
                  for i, kind in enumerate(("wall", "cpu"))} for m in MODES[1:]}
    load = os.getloadavg()[0]
    result = {"steps": steps, "repeats": repeats, "seconds": times, "ratio_to_sparse": ratios, "load_1min": load,
              "date": time.strftime("%Y-%m-%d")}
    if not args.quick:
        (HERE / "logging_cost.json").write_text(json.dumps(result, indent=1) + "\n")
        rows = {"dense": "the last first; 64 composed lines, those before the last on a coarse grid (today)",
                "dense_fine_lines": "64 composed lines on the run's grid (before)",
                "dense_every_line_exact": "every line composed on the run's grid (before that)"}
        lines = ["# What logging often costs a long run", "",
                 f"Default job, {steps} steps, {repeats} interleaved repeats, each from an empty epsilon cache; "
                 f"1-minute load {load:.1f} on this machine ({result['date']}). Ratios of `train()` to "
                 "`logging_steps=1000` (median): wall time, and the process's CPU time (all threads).", "",
                 "| logging | schedule | wall | CPU |", "|---|---|---|---|",
                 *(f"| every 10 steps | {rows[m]} | {ratios[m]['wall']:.2f}x | {ratios[m]['cpu']:.2f}x |"
                   for m in MODES[1:]), ""]
        (HERE / "LOGGING_COST.md").write_text("\n".join(lines))
    print(json.dumps(result["ratio_to_sparse"]))
    return result


if __name__ == "__main__":
    main()
