"""What logging often costs a long run (issue 24): the epsilon on every logged line is a PLD composition.

    python -m benchmarks.logging_cost [--quick] [--steps N] [--repeats R]   # writes its json and markdown
                                                                           # next to this script (not --quick)

The default job (digits, MLP, DP-SGD at epsilon 8, tracking off) for ``--steps`` steps (3000; quick: 1000), run
three ways side by side, interleaved, each repeat from an empty epsilon cache (a rerun would read its schedule back):
- ``sparse``: ``logging_steps=1000`` (a handful of compositions: the floor);
- ``dense``: ``logging_steps=10``, the default, with today's schedule (exact at ``EXACT_LINES`` lines, the rest an
  upper bound from the next exact line; workbench/privacy/accounting/accountant.py);
- ``dense_every_line_exact``: the same with every line composed exactly (the schedule before this change).
The row is the median ratio of each to ``sparse`` in wall time of ``train()``. A ratio, not seconds: these machines
are shared and noisy.
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
MODES = ("sparse", "dense", "dense_every_line_exact")


def _run(mode: str, steps: int, seed: int) -> float:
    from workbench import compose, train
    from workbench.privacy.accounting import accountant

    every = 1000 if mode == "sparse" else 10
    original = accountant.exact_steps
    if mode == "dense_every_line_exact":
        accountant.exact_steps = lambda lines, n=None: list(lines)
    try:
        with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(io.StringIO()):
            os.environ["WORKBENCH_CACHE_DIR"] = cache
            t = time.perf_counter()
            train(compose([f"max_steps={steps}", f"logging_steps={every}", "tracking.enabled=false",
                           "disable_tqdm=true", f"seed={seed}", f"output_dir={cache}/run"]))
            return time.perf_counter() - t
    finally:
        accountant.exact_steps = original


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    steps = args.steps or (1000 if args.quick else 3000)
    repeats = args.repeats or (1 if args.quick else 2)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(repeats):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):  # interleaved, the order alternating
            times[mode].append(_run(mode, steps, r))
            print(f"{mode}: {times[mode][-1]:.1f} s", flush=True)
    ratios = {m: statistics.median(a / b for a, b in zip(times[m], times["sparse"])) for m in MODES[1:]}
    load = os.getloadavg()[0]
    result = {"steps": steps, "repeats": repeats, "seconds": times, "ratio_to_sparse": ratios, "load_1min": load,
              "date": time.strftime("%Y-%m-%d")}
    if not args.quick:
        (HERE / "logging_cost.json").write_text(json.dumps(result, indent=1) + "\n")
        lines = ["# What logging often costs a long run", "",
                 f"Default job, {steps} steps, {repeats} interleaved repeats, each from an empty epsilon cache; "
                 f"1-minute load {load:.1f} on this machine ({result['date']}). Ratio of `train()` wall time to "
                 "`logging_steps=1000` (median).", "",
                 "| logging | schedule | ratio to sparse logging |", "|---|---|---|",
                 f"| every 10 steps | exact at <= 64 lines, the rest the next exact value | "
                 f"{ratios['dense']:.2f}x |",
                 f"| every 10 steps | every line exact (before) | {ratios['dense_every_line_exact']:.2f}x |", ""]
        (HERE / "LOGGING_COST.md").write_text("\n".join(lines))
    print(json.dumps(result["ratio_to_sparse"]))
    return result


if __name__ == "__main__":
    main()
