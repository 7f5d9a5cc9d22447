"""``python -m benchmarks [--quick] [--out DIR] [--only FIG,...]``: run the figures, write results.json + RESULTS.md."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path

FIGURES = ("dp_vs_nonprivate", "vs_opacus", "distributed_scaling", "scaling_vs_ddp", "accounting", "tracking_overhead", "startup",
           "end_to_end", "real_size")


def _summary(name: str, fig: dict) -> dict[str, float]:
    """A few positive headline numbers per figure (what tests check is present and positive)."""
    if name == "dp_vs_nonprivate":
        return {f"{m}/{row}/{k}": v[k] for m, mv in fig["presets"].items() for row, v in mv["rows"].items()
                for k in ("samples_per_s", "throughput_vs_non_private", "peak_memory_vs_non_private",
                          "vs_opacus_ghost") if k in v}
    if name == "vs_opacus":
        return {f"{m}/{row}/{k}": v[k] for m, mv in fig["models"].items() for row, v in mv["rows"].items()
                for k in ("samples_per_s", "vs_opacus_hooks")}
    if name == "distributed_scaling":
        out = {f"{k}/{m}": v[m] for k, v in fig["rows"].items()
               for m in ("per_rank_samples_per_s_w1", "per_rank_samples_per_s_w2", "w2_vs_w1_per_rank")}
        out.update({f"allreduce/{k}/{m}": v[m] for k, v in fig["allreduce"].items()
                    for m in ("flat_us_per_step", "per_parameter_us_per_step", "per_parameter_vs_flat")})
        return out
    if name == "scaling_vs_ddp":
        out = {f"w{w}/{k}/samples_per_s": x for w, v in fig["world_sizes"].items() for k, x in v["samples_per_s"].items()}
        return {**out, **{f"efficiency/{k}": v for k, v in fig["efficiency"].items()}, "ours_vs_ddp": fig["ours_vs_ddp"]}
    if name == "accounting":
        out = {f"epsilon/{k}/seconds": v["seconds_fresh"] for k, v in fig["epsilon"].items()}
        out.update({f"calibrate/{k}/seconds": v["seconds"] for k, v in fig["calibrate"].items()})
        out.update({f"parallel_poisson/{k}/calibrate_seconds": v["calibrate_seconds"]
                    for k, v in fig["parallel_poisson"].items()})
        return out
    if name == "tracking_overhead":
        return {k: fig[k] for k in ("step_ms_tracking_on", "step_ms_tracking_off", "ab_on_vs_off",
                                    "log_metrics_ms_per_call", "epsilon_ms_per_call")}  | {
            "system_metrics_1s_vs_off": fig["system_metrics"]["ab_sampling_vs_off"]}
    if name == "startup":
        return {f"{k}/first_step_s": v["first_step"] for k, v in fig["variants"].items()}
    if name == "real_size":
        return {f"{m}/{row}/{k}": v[k] for m, mv in fig["presets"].items() for row, v in mv["rows"].items()
                for k in ("samples_per_s", "throughput_vs_non_private", "peak_memory_vs_non_private",
                          "vs_opacus_ghost") if k in v}
    if name == "end_to_end":
        return {**{f"{k}/median_seconds": v for k, v in fig["median_seconds"].items()},
                "workbench_vs_raw_opacus": fig["workbench_vs_raw_opacus"]}
    raise KeyError(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="CI-sized run (well under 3 minutes on 2 cores)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="folder for results.json and RESULTS.md (default: benchmarks/)")
    parser.add_argument("--only", default=",".join(FIGURES),
                        help=f"comma-separated subset of: {', '.join(FIGURES)} (the other figures in --out/results.json "
                             "of the same mode are kept)")
    parser.add_argument("--render", action="store_true",
                        help="only re-write RESULTS.md from the results.json already in --out (no measuring)")
    args = parser.parse_args(argv)
    if args.render:

        from benchmarks import report

        results = json.loads((args.out / "results.json").read_text())
        first = next(iter(results.values()))
        total = sum(fig["seconds"] for fig in results.values())
        (args.out / "RESULTS.md").write_text(report.render(results, first["mode"], first["command"],
                                                           first["machine"], total))
        print(f"wrote {args.out / 'RESULTS.md'} from {args.out / 'results.json'}")
        return 0
    only = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = sorted(set(only) - set(FIGURES))
    if unknown:
        parser.error(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURES)}")

    warnings.filterwarnings("ignore")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from benchmarks import accounting, end_to_end, real_size, report, scaling, startup, throughput, tracking
    from benchmarks.common import Settings, dump_json, machine_info, set_threads

    set_threads()
    settings = Settings.for_mode(args.quick)
    command = "python -m benchmarks" + (" --quick" if args.quick else "")
    if set(only) != set(FIGURES):
        command += f" --only {','.join(only)}"
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    print(f"benchmarks ({settings.mode} mode) on {machine['cpu']}, {machine['cores']} cores, torch "
          f"{machine['versions']['torch']}, 1 thread per process; load average {machine['load_avg_1min']}", flush=True)

    results: dict = {}
    previous = args.out / "results.json"
    if set(only) != set(FIGURES) and previous.exists():  # --only re-measures some figures and keeps the others
        results = {k: v for k, v in json.loads(previous.read_text()).items() if v.get("mode") == settings.mode}
    t_all = time.perf_counter()
    for name in FIGURES:
        if name not in only:
            continue
        print(f"[{name}]", flush=True)
        load_before = os.getloadavg()[0]
        t = time.perf_counter()
        if name == "dp_vs_nonprivate":
            fig = throughput.dp_vs_nonprivate(settings)
        elif name == "vs_opacus":
            fig = throughput.vs_opacus(settings)
        elif name == "distributed_scaling":
            fig = scaling.distributed_scaling(settings)
        elif name == "scaling_vs_ddp":
            fig = scaling.scaling_vs_ddp(settings)
        elif name == "accounting":
            fig = accounting.accounting(settings)
        elif name == "tracking_overhead":
            fig = tracking.tracking_overhead(settings)
        elif name == "startup":
            fig = startup.startup(settings)
        elif name == "end_to_end":
            fig = end_to_end.end_to_end(settings)
        else:
            fig = real_size.figure(settings)
        seconds = time.perf_counter() - t
        fig.setdefault("info", [])
        results[name] = {
            **fig, "summary": _summary(name, fig),
            "mode": settings.mode, "command": command, "threads_per_process": 1, "seconds": seconds,
            "machine": {**machine, "load_avg_1min_before": round(load_before, 2),
                        "load_avg_1min_after": round(os.getloadavg()[0], 2)},
        }
        print(f"  ({seconds:.0f} s)", flush=True)
        dump_json(results, args.out / "results.json")  # partial results survive a later failure
    total = time.perf_counter() - t_all
    results = {name: results[name] for name in FIGURES if name in results}
    (args.out / "RESULTS.md").write_text(report.render(results, settings.mode, command, machine, total))
    print(f"wrote {args.out / 'results.json'} and {args.out / 'RESULTS.md'} in {total:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
