"""What logging often costs a long run (issue 24): the epsilon on every logged line is a PLD composition.

    python -m benchmarks.logging_cost [--quick] [--steps N ...] [--repeats R] [--long-steps L] # writes its json and markdown
                                                                           # next to this script (not --quick)

The default job (digits, MLP, DP-SGD at epsilon 8, tracking off) for each of ``--steps`` (170 and 3000; quick: 1000), run
three ways side by side, interleaved, each repeat from an empty epsilon cache (a rerun would read its schedule back):
- ``sparse``: ``logging_steps=1000`` (a handful of compositions: the floor);
- ``dense``: ``logging_steps=10``, the default, with today's schedule (the last line first, composed at
  ``EXACT_LINES`` lines, those before the last on the coarsest PLD grid within 0.5 % of the run's;
  workbench/privacy/accounting/accountant.py), each composition through ``StepPLD`` (the step's Chernoff truncation
  bounds computed once; workbench/privacy/accounting/pld.py);
- ``dense_before``: the schedule before ``StepPLD``: every composition through dp_accounting's ``self_compose`` (which
  recomputes those bounds each time), and a run of at most ``EXACT_LINES`` lines composing every line on its own grid.
The rows are the median ratios of each to ``sparse``, in wall time of ``train()`` and in the process's CPU time (all
threads: the schedule's thread included; steadier than wall time on a shared machine). Ratios, not seconds.

The long-run proxy (``--long-steps``, 100,000): a 100,000-step job takes ~10 minutes per run here, too long to repeat
on two shared cores, so its schedule is measured alone: the CPU time of building the schedule of a ``logging_steps=10``
run of that length (sigma calibrated for it; the last line's composition included, though the run's budget check has
usually cached it) against the CPU time of training as many steps at the ``sparse`` runs' measured rate. Everything
else that dense logging adds is per logged line, as training is per step, so its share does not grow with the run;
the schedule is at most ``EXACT_LINES`` compositions whatever the run's length.
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
MODES = ("sparse", "dense", "dense_before")
STEPS = (170, 3000)  # about the default job (30 epochs of digits: 169 steps), and a long one
LONG_STEPS = 100_000


def _run(mode: str, steps: int, seed: int) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of the whole process, CPU seconds of the schedule's thread) of one train()."""
    import resource

    from workbench import compose as compose_cfg
    from workbench import train
    from workbench.privacy.accounting import accountant, pld

    every = 1000 if mode == "sparse" else 10
    compose, lines = pld.StepPLD.self_compose, accountant.EpsilonSchedule.lines_accountant
    work, thread_cpu = accountant.EpsilonSchedule._work, [0.0]  # pylint: disable=protected-access

    def timed_work(self):  # the schedule's thread: its own CPU time, whatever else the process does
        work(self)
        thread_cpu[0] += time.thread_time()

    accountant.EpsilonSchedule._work = timed_work  # pylint: disable=protected-access
    if mode == "dense_before":  # dp_accounting's self_compose every time; a short schedule on the run's own grid
        pld.StepPLD.self_compose = lambda self, n: self.pld.self_compose(n)
        accountant.EpsilonSchedule.lines_accountant = lambda self, last: (
            self.accountant if len(self.steps) <= accountant.EXACT_LINES else lines(self, last))
    try:
        with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(io.StringIO()):
            os.environ["WORKBENCH_CACHE_DIR"] = cache
            cpu, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            train(compose_cfg([f"max_steps={steps}", f"logging_steps={every}", "tracking.enabled=false",
                               "disable_tqdm=true", f"seed={seed}", f"output_dir={cache}/run"]))
            wall, end = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
            return wall, (end.ru_utime - cpu.ru_utime) + (end.ru_stime - cpu.ru_stime), thread_cpu[0]
    finally:
        pld.StepPLD.self_compose, accountant.EpsilonSchedule.lines_accountant = compose, lines
        accountant.EpsilonSchedule._work = work  # pylint: disable=protected-access


def _schedule_cpu(steps: int) -> dict:
    """CPU seconds of building the epsilon schedule of a ``logging_steps=10`` default job of ``steps`` steps, alone
    (sigma calibrated for that length, as the job calibrates it; not timed)."""
    from workbench import compose as compose_cfg
    from workbench.data import Digits
    from workbench.privacy.accounting import Accountant, EpsilonSchedule, calibrate_noise, default_delta
    from workbench.trainer import logging_steps

    cfg, n = compose_cfg([f"max_steps={steps}"]), len(Digits("train"))
    q, delta = cfg.per_device_train_batch_size / n, default_delta(n)  # the job's q (W=1) and delta
    with tempfile.TemporaryDirectory() as cache:
        os.environ["WORKBENCH_CACHE_DIR"] = cache
        sigma = calibrate_noise("pld", q, steps, cfg.privacy.target_epsilon, delta)
        t = time.process_time()
        schedule = EpsilonSchedule(Accountant("pld", q, sigma), delta, logging_steps(0, steps, 10))
        schedule._thread.join()  # pylint: disable=protected-access
        return {"steps": steps, "lines": len(schedule.steps), "composed": len(schedule.exact), "sigma": sigma,
                "cpu_s": time.process_time() - t}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--long-steps", type=int, default=LONG_STEPS)
    args = parser.parse_args(argv)
    lengths = args.steps or ([1000] if args.quick else list(STEPS))
    repeats = args.repeats or (1 if args.quick else 2)
    _run("sparse", 20, 99)  # untimed: the first train() of a process pays its one-time imports and caches
    times = {n: {m: [] for m in MODES} for n in lengths}
    for r in range(repeats):
        for n in lengths:
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):  # interleaved, the order alternating
                times[n][mode].append(_run(mode, n, r))
                print(f"{n} steps, {mode}: " + ", ".join(f"{x:.2f} s {k}" for x, k in zip(
                    times[n][mode][-1], ("wall", "CPU", "schedule CPU"))), flush=True)
    ratios = {n: {m: {kind: statistics.median(a[i] / b[i] for a, b in zip(t[m], t["sparse"]))
                      for i, kind in enumerate(("wall", "cpu"))} for m in MODES[1:]} for n, t in times.items()}
    for n, t in times.items():  # the steadier figure: the schedule thread's CPU over the sparse run's (all threads)
        for m in MODES[1:]:
            ratios[n][m]["schedule_cpu_share"] = statistics.median(
                (a[2] - b[2]) / b[1] for a, b in zip(t[m], t["sparse"]))
    longest = max(lengths)
    cpu_per_step = statistics.median(t[1] for t in times[longest]["sparse"]) / longest  # start-up included: high
    long = _schedule_cpu(args.long_steps)
    long["training_cpu_s_estimate"] = cpu_per_step * args.long_steps
    long["schedule_share"] = long["cpu_s"] / long["training_cpu_s_estimate"]
    print(f"long-run proxy: {long}", flush=True)
    load = os.getloadavg()[0]
    result = {"steps": lengths, "repeats": repeats, "seconds": times, "ratio_to_sparse": ratios, "long_run": long,
              "load_1min": load, "date": time.strftime("%Y-%m-%d")}
    if not args.quick:
        (HERE / "logging_cost.json").write_text(json.dumps(result, indent=1) + "\n")
        rows = {"dense": "the last first; at most 64 composed lines, those before the last on a coarse grid; each "
                         "composition reusing the step's truncation bounds (`StepPLD`, today)",
                "dense_before": "before: each composition by dp_accounting's `self_compose`; at most 64 lines all on the "
                                "run's own grid"}
        lines = ["# What logging often costs a run", "",
                 f"Default job, {repeats} interleaved repeats, each from an empty epsilon cache; 1-minute load "
                 f"{load:.1f} on this machine (2 cores shared with other work; {result['date']}). Ratios of `train()` "
                 "logging every 10 steps to the same job logging every 1000 (median): wall time, and the process's "
                 "CPU time (all threads: the schedule's included).", "",
                 "| steps | schedule | wall | CPU | schedule thread's extra CPU / sparse run's CPU |",
                 "|---|---|---|---|---|",
                 *(f"| {n} | {rows[m]} | {ratios[n][m]['wall']:.2f}x | {ratios[n][m]['cpu']:.2f}x | "
                   f"{100 * ratios[n][m]['schedule_cpu_share']:.1f} % |" for n in lengths for m in MODES[1:]), "",
                 "The last column is the steadier one on a shared machine: the epsilon schedule thread's own CPU time "
                 "(`time.thread_time`) beyond the sparse run's, over the sparse run's whole CPU time; the whole-run "
                 "ratios move by several percent between repeats with the machine's load.", "",
                 "Earlier schedules at 3000 steps (measured 2026-12-01, load 2.9): the coarse-grid lines through "
                 "dp_accounting's `self_compose` 1.04x wall (1.09x CPU); 64 composed lines on the run's own grid 1.13x "
                 "(1.23x); every line composed on the run's grid 2.84x (3.20x).", "",
                 f"Long runs (a proxy; see the script's docstring): the schedule of a {long['steps']:,}-step job "
                 f"logging every 10 steps ({long['lines']:,} lines, {long['composed']} compositions, sigma "
                 f"{long['sigma']:.2f}) takes {long['cpu_s']:.2f} s of CPU alone, against about "
                 f"{long['training_cpu_s_estimate']:.0f} s of CPU to train those steps at the {longest}-step sparse "
                 f"runs' rate (start-up included, so a little high): {100 * long['schedule_share']:.2f} % of the run. "
                 "The rest of dense logging's cost is per line, as training is per step, so its share does not grow "
                 "with the run's length.", ""]
        (HERE / "LOGGING_COST.md").write_text("\n".join(lines))
    print(json.dumps(result["ratio_to_sparse"]))
    return result


if __name__ == "__main__":
    main()
