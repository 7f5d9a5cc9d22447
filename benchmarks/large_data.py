"""Large datasets (issue 44): what one step's Poisson batch costs a rank at N = 1e5 ... 1e9, and the accounting of a
1,024-rank ``shard=global`` job.

    python -m benchmarks.large_data [--quick] [--out DIR]   # writes DIR/large_data.json and DIR/LARGE_DATA.md

A world of W = 1,024 ranks simulated in one process, no collectives: each simulated rank draws its own batch from its
own shard with its own stream (``per_rank``: N examples per rank, q = 1,000 / N; ``global``: every rank over all N, q
= B / (W N) with B = 1,000 W; ``cyclic``: BandMF's part t mod 8 of a rank's N at p = 8 x 1,000 / N), so each rank
expects 1,000 examples a step. The time is the median over steps of one step's draws divided by the ranks drawn; the
memory is the growth of the process's peak resident set over the draws (every point in a fresh process) and, for the
new sampler, tracemalloc's peak over one more step of 8 ranks (numpy's and Python's allocations, traced apart from the
timed steps). ``old`` is the sampler before issue 44 (a float32
uniform per example of the shard, ``u < q``), rebuilt here for the comparison, on 2 simulated ranks where feasible
(N <= 1e8). The accounting row is sigma's calibration and one epsilon at W = 1,024, ``shard=global``, N = 1e9.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

from benchmarks.common import REPO, median, set_threads

SIZES = (10**5, 10**6, 10**7, 10**8, 10**9)
WORLD, PER_RANK_BATCH, BANDS, OLD_RANKS = 1024, 1000, 8, 2
KINDS = ("per_rank", "global", "cyclic")
TARGET_MS = 1.0  # issue 44: <= 1 ms per step per rank at N = 1e9
EPS, DELTA, STEPS = 8.0, 1e-10, 10_000  # the accounting row: delta below 1 / N at N = 1e9


def _samplers(kind: str, n: int, ranks: int, old: bool):
    """One draw function per simulated rank: step -> that rank's batch (a list of dataset indices)."""
    import torch

    from workbench.privacy.cyclic import CyclicPoissonBatchSampler
    from workbench.privacy.sampling import PoissonBatchSampler, Shard, step_generator

    out = []
    for rank in range(ranks):
        if kind == "global":
            shard = Shard(range(n), n, PER_RANK_BATCH / n, 0, PER_RANK_BATCH * WORLD)
        else:
            rate = PER_RANK_BATCH * (BANDS if kind == "cyclic" else 1) / n
            shard = Shard(range(rank * n, (rank + 1) * n), n * WORLD, rate, 0, PER_RANK_BATCH * WORLD)
        if old:
            def draw(step, shard=shard, rank=rank, size=n // (BANDS if kind == "cyclic" else 1)):
                mask = torch.rand(size, generator=step_generator(0, rank, step)) < shard.sample_rate
                return (mask.nonzero().squeeze(1) + shard.indices.start).tolist()
        elif kind == "cyclic":
            draw = CyclicPoissonBatchSampler(shard, BANDS, 10**9, seed=0, rank=rank).indices_for_step
        else:
            draw = PoissonBatchSampler(shard, 10**9, seed=0, rank=rank).indices_for_step
        out.append(draw)
    return out


def point(kind: str, n: int, old: bool, ranks: int, steps: int) -> dict:
    """One (kind, sampler, N), in this (fresh) process."""
    set_threads()
    draws = _samplers(kind, n, ranks, old)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, drawn = [], 0
    for step in range(steps):
        t = time.perf_counter()
        for draw in draws:
            drawn += len(draw(step))
        times.append((time.perf_counter() - t) / ranks)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    traced = None
    if not old:  # apart from the timed steps: tracing slows every allocation
        tracemalloc.start()
        for draw in draws[:8]:
            draw(steps)
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return {"kind": kind, "n": n, "sampler": "old" if old else "new", "ranks": ranks, "steps": steps,
            "ms_per_rank_step": 1e3 * median(times), "runs_ms": [1e3 * x for x in times],
            "mean_batch": drawn / (steps * ranks), "peak_rss_growth_mib": grown / 1024,
            **({"traced_peak_kib": traced / 1024} if traced is not None else {})}


def accounting(steps: int) -> dict:
    from workbench import privacy

    q = PER_RANK_BATCH / 10**9
    t = time.perf_counter()
    sigma = privacy.calibrate_noise("pld", q, steps, EPS, DELTA, WORLD, "global")
    calibrate = time.perf_counter() - t
    t = time.perf_counter()
    eps = privacy.Accountant("pld", q, sigma, WORLD, "global").epsilon(steps, DELTA)
    return {"world_size": WORLD, "shard": "global", "n": 10**9, "sample_rate_per_rank": q, "steps": steps,
            "target_epsilon": EPS, "delta": DELTA, "noise_multiplier": sigma, "epsilon": eps,
            "calibrate_seconds": calibrate, "epsilon_seconds": time.perf_counter() - t}


def _in_fresh_process(*args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.large_data", "--point", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(quick: bool) -> dict:
    old_up_to, steps = (10**6, 5) if quick else (10**8, 10)
    rows = []
    for kind in KINDS:
        for n in SIZES:
            rows.append(_in_fresh_process(kind, n, 0, 64 if quick else WORLD, steps))
            if kind != "cyclic" and n <= old_up_to:
                rows.append(_in_fresh_process(kind, n, 1, OLD_RANKS, 3 if n >= 10**8 else steps))
            r = rows[-1]
            print(f"  {kind} N={n:.0e}: " + ", ".join(f"{x['sampler']} {x['ms_per_rank_step']:.3f} ms/rank-step "
                  f"(+{x['peak_rss_growth_mib']:.0f} MiB)" for x in rows if x["kind"] == kind and x["n"] == n),
                  flush=True)
    new_at_1e9 = max(r["ms_per_rank_step"] for r in rows if r["sampler"] == "new" and r["n"] == 10**9)
    acc = accounting(1000 if quick else STEPS)
    print(f"  accounting W={WORLD} global: calibration {acc['calibrate_seconds']:.1f} s, epsilon "
          f"{acc['epsilon_seconds']:.1f} s", flush=True)
    return {"mode": "quick" if quick else "full", "world_size": WORLD, "per_rank_batch": PER_RANK_BATCH,
            "bands": BANDS, "rows": rows, "accounting": acc,
            "target": {"what": "new sampler, ms per step per rank at N = 1e9 (slowest kind)", "value": new_at_1e9,
                       "goal": TARGET_MS, "met": new_at_1e9 <= TARGET_MS}}


def render(result: dict) -> str:
    lines = ["# Large datasets (`python -m benchmarks.large_data`)", "", __doc__.split("\n\n")[2].strip(), "",
             f"Mode: {result['mode']}. Target: {result['target']['what']} <= {result['target']['goal']} ms: "
             f"{result['target']['value']:.3f} ms, {'met' if result['target']['met'] else 'missed'}.", "",
             "| kind | N per rank | new: ms / step / rank | new: peak RSS growth | new: traced peak | "
             "old: ms / step / rank | old: peak RSS growth |", "|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        for n in SIZES:
            new = next(r for r in result["rows"] if (r["kind"], r["n"], r["sampler"]) == (kind, n, "new"))
            old = next((r for r in result["rows"] if (r["kind"], r["n"], r["sampler"]) == (kind, n, "old")), None)
            lines.append(f"| {kind} | {n:.0e} | {new['ms_per_rank_step']:.3f} | {new['peak_rss_growth_mib']:.1f} MiB | "
                         f"{new['traced_peak_kib']:.0f} KiB | "
                         + (f"{old['ms_per_rank_step']:.1f} | {old['peak_rss_growth_mib']:.0f} MiB |" if old else
                            "not run | |"))
    a = result["accounting"]
    lines += ["", f"Accounting, W = {a['world_size']}, shard={a['shard']}, N = {a['n']:.0e} (q_r = "
              f"{a['sample_rate_per_rank']:.0e}), {a['steps']} steps, epsilon {a['target_epsilon']} at delta "
              f"{a['delta']:g}: sigma calibrated in {a['calibrate_seconds']:.1f} s (sigma {a['noise_multiplier']:.4f}), "
              f"one epsilon in {a['epsilon_seconds']:.1f} s."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(REPO / "benchmarks"))
    parser.add_argument("--point", nargs=5, metavar=("KIND", "N", "OLD", "RANKS", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        kind, n, old, ranks, steps = args.point
        print(json.dumps(point(kind, int(n), bool(int(old)), int(ranks), int(steps))))
        return
    result = run(args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "large_data.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "LARGE_DATA.md").write_text(render(result))


if __name__ == "__main__":
    main()
