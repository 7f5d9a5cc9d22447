"""Where a step's time goes on the ``gpt`` and ``vit`` presets (issue 24): torch.profiler (CPU, one thread) over a few
steps of the non-private step and of ``auto`` (book-keeping), after warm-up; the top operators by self CPU time.

    python -m benchmarks.profile_presets [--steps 3] [--top 12]     # one markdown table per preset and step, printed
                                                                    # and written to benchmarks/PROFILE_GPT_VIT.md
"""

from __future__ import annotations

import argparse
import os
import subprocess
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


def main(steps: int = 3, top: int = 12) -> None:
    warnings.filterwarnings("ignore")
    from benchmarks.common import set_threads
    from benchmarks.presets import preset
    from benchmarks.throughput import plain_step, workbench_step

    set_threads()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    lines = ["# Where the step's time goes: gpt and vit presets (issue 24)", "",
             f"`python -m benchmarks.profile_presets --steps {steps} --top {top}`: torch.profiler (CPU, one thread), self "
             "CPU time per step of each operator, after warm-up, averaged over the profiled steps. Python time between "
             f"operators is not in these numbers. Load at the start: `{load}`.", ""]
    for name in ("gpt", "vit"):
        p = preset(name)
        kw = dict(criterion=p.criterion(reduction="none"), expected_batch=p.batch_size,
                  max_physical_batch_size=p.cfg.max_physical_batch_size, check_on=p.first_examples(8))
        batches = p.poisson_batches(steps + 2)
        for label, st in (("non-private", plain_step(p.model(), p.criterion(reduction="none"))),
                          ("auto (bk)", workbench_step(p.model(), "auto", **kw))):
            total, rows = profile_rows(st, batches, steps, top)
            lines += [f"## {name}, {label}: {total:.1f} ms self CPU per step (expected batch {p.batch_size})", "",
                      "| operator | ms/step | % | calls/step |", "|---|---:|---:|---:|"]
            lines += [f"| `{key}` | {ms:.2f} | {100 * ms / total:.0f} | {calls} |" for key, ms, calls in rows]
            lines.append("")
    text = "\n".join(lines)
    print(text)
    (Path(__file__).resolve().parent / "PROFILE_GPT_VIT.md").write_text(text)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    main(a.steps, a.top)
