"""Where a step's time goes on a preset (issue 24): torch.profiler (CPU, one thread) over a few steps of the
non-private step, of ``auto`` (book-keeping) and, on the MLP, of ``bare_dp`` (benchmarks.throughput's DP step written
out by hand, the floor), after warm-up; the top operators by self CPU time, and the Python function calls a step makes
(cProfile), which on a small model weigh as much as the operators.

    python -m benchmarks.profile_presets [--steps 3] [--top 12]     # gpt and vit: benchmarks/PROFILE_GPT_VIT.md
    python -m benchmarks.profile_presets --presets mlp --out benchmarks/PROFILE_MLP.md
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def profile_rows(step, batches, steps: int, top: int, warm: int = 2) -> tuple[float, list[tuple[str, float, int]]]:
    """(ms per step, [(operator, self CPU ms per step, calls per step)] of the ``top`` costliest), after ``warm``
    untimed steps (0: a step already warmed by its caller)."""
    from torch.profiler import ProfilerActivity, profile

    for b in batches[:warm]:
        step(b, 0)  # warm: lazily made state is not the step's
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(steps):
            step(batches[s % len(batches)], s)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    rows = sorted(((e.key, e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in events),
                  key=lambda r: -r[1])
    return total, rows[:top]


def thread_ms(step, batches, steps: int) -> float:
    """ms of this thread's CPU time per step, unprofiled (operators, Python and dispatch together)."""
    start = time.thread_time()
    for s in range(steps):
        step(batches[s % len(batches)], s)
    return (time.thread_time() - start) * 1e3 / steps


def python_calls(step, batches, steps: int) -> int:
    """Python function calls per step (cProfile's count, C functions included), the step already warm."""
    prof = cProfile.Profile()
    prof.enable()
    for s in range(steps):
        step(batches[s % len(batches)], s)
    prof.disable()
    return round(sum(row[1] for row in pstats.Stats(prof).stats.values()) / steps)


def main(steps: int = 3, top: int = 12, names: tuple[str, ...] = ("gpt", "vit"),
         out: Path = Path(__file__).resolve().parent / "PROFILE_GPT_VIT.md") -> None:
    warnings.filterwarnings("ignore")
    from benchmarks.common import set_threads
    from benchmarks.presets import preset
    from benchmarks.throughput import bare_dp_step, plain_step, workbench_step

    set_threads()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    flags = "" if names == ("gpt", "vit") else f" --presets {','.join(names)} --out {out.name}"
    lines = [f"# Where the step's time goes: {', '.join(names)} (issue 24)", "",
             f"`python -m benchmarks.profile_presets --steps {steps} --top {top}{flags}`: torch.profiler (CPU, one "
             "thread), self CPU time per step of each operator, after warm-up, averaged over the profiled steps. "
             "Python time between operators is not in these numbers: each heading gives the step's unprofiled thread "
             "CPU time beside them, and the Python function calls a step makes (cProfile, C functions included). "
             f"Load at the start: `{load}`.", ""]
    for name in names:
        p = preset(name)
        kw = dict(criterion=p.criterion(reduction="none"), expected_batch=p.batch_size,
                  max_physical_batch_size=p.cfg.max_physical_batch_size, check_on=p.first_examples(8))
        batches = p.poisson_batches(steps + 2)
        configs = [("non-private", plain_step(p.model(), p.criterion(reduction="none")))]
        try:
            configs.append(("bare_dp (the floor, not private as written)",
                            bare_dp_step(p.model(), p.criterion(reduction="none"), p.batch_size)))
        except TypeError:
            pass  # a model with other layers than Linear rows: no hand-written floor
        configs.append(("auto (bk)", workbench_step(p.model(), "auto", **kw)))
        for label, st in configs:
            total, rows = profile_rows(st, batches, steps, top)
            calls, ms = python_calls(st, batches, steps), thread_ms(st, batches, steps)
            lines += [f"## {name}, {label}: {total:.2f} ms self CPU per step in operators of {ms:.2f} ms unprofiled, "
                      f"{calls:,} Python calls (expected batch {p.batch_size})", "",
                      "| operator | ms/step | % | calls/step |", "|---|---:|---:|---:|"]
            lines += [f"| `{key}` | {ms:.2f} | {100 * ms / total:.0f} | {calls} |" for key, ms, calls in rows]
            lines.append("")
    text = "\n".join(lines)
    print(text)
    out.write_text(text)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--presets", default="gpt,vit", help="comma-separated preset names (benchmarks.presets)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "PROFILE_GPT_VIT.md")
    a = ap.parse_args()
    main(a.steps, a.top, tuple(a.presets.split(",")), a.out.resolve())
