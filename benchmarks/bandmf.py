"""BandMF and BLT versus DP-SGD (issue 22's figure): eval accuracy at epsilon 1, 3 and 8 on the embedded default job, same
steps and batch, several seeds; and what generating the correlated noise costs per step.

    python -m benchmarks.bandmf [--quick] [--seeds N] [--text]   # writes benchmarks/bandmf.json, BANDMF.md and
                                                                 # docs/bandmf_vs_dpsgd.png

Accuracy. Each point is ``workbench.train(compose([...]))`` on the default job (digits, MLP, 30 epochs: 169 steps of
expected batch 256, learning_rate 1.5, C = 1, delta 1e-5) with ``privacy.target_epsilon`` in 1, 3, 8, once with
``privacy.mechanism=dpsgd`` and with ``privacy.mechanism=bandmf`` at ``privacy.num_bands`` 2 and 4; ``max_steps``
is fixed so that all make the same steps; each calibrates its own sigma to the same epsilon. Why b = 2 and 4: cyclic
Poisson samples part t mod b of the data at p = b B / N, which must be <= 1; on digits (N = 1436 after the cut to a
multiple of b, B = 256) that allows b <= 5. More bands cancel more noise but raise p (b = 2: 0.36, b = 4: 0.71,
b = 5: 0.89, against DP-SGD's 0.18), losing amplification by sampling; b = 4 is near the most the constraint allows,
b = 2 the middle ground. Nothing else is tuned for BandMF (the learning rate is DP-SGD's): this is the same job with
the other mechanism. BLT (``privacy.mechanism=blt``, d = 4 buffers, digits panel only) walks k = floor(N / B) = 5
fixed batches (N_used = 1280) without amplification: every example takes part every 5th step, 34 times in 169
steps, and its sigma is calibrated for that one Gaussian mechanism. Seeds 0 .. N-1 (``--seeds``, 3 by default), the noise from a fresh secret per run. ``--text``
adds a second panel, the text_classifier preset (tiny BERT, 80 steps of B = 256 over 8000 synthetic sentences, b = 4:
p = 0.128; needs the hf extra), DP-SGD and b = 4 only: about 30 s a run on 2 shared cores against the digits job's 5 s.
``--only text_classifier`` measures that panel alone and keeps the digits panel already in the json (how the
committed figure was made: the digits panel, then the text one apart; the noise row is the later run's).
Accuracy is not speed: it does not depend on the machine's load.

Noise cost. On one flat buffer of 2^20 float32 numbers (a ~1M-parameter model), the time of one step's ``add_`` of
``GaussianNoise`` (DP-SGD: one draw), of ``BandedNoise`` at b = 4 and b = 16 (one draw and b - 1 axpys against
the ring) and of ``BLTNoise`` at d = 4 (one draw, d axpys and d scale-and-adds), after the ring has filled, in interleaved timed blocks in one process (median of the blocks), and the
memory each keeps between steps (its buffers' bytes: DP-SGD 1 x the model, BandMF b x, BLT d + 1 x the model).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.adaptive_clipping import bars_on, quiet, summarize, train_point
from benchmarks.common import REPO, set_threads

EPSILONS = (1.0, 3.0, 8.0)
BANDS = (2, 4)
MECHANISMS = ("dpsgd", *(f"bandmf b={b}" for b in BANDS), "blt d=4")
JOBS = {
    "digits": {"title": "default job (digits, MLP)", "overrides": ["max_steps=169"], "quick": ["max_steps=40"],
               "series": MECHANISMS},
    # text: ~30 s a run on 2 shared cores (the digits job: ~5 s), so only DP-SGD and b = 4 by default
    "text_classifier": {"title": "text_classifier (tiny BERT, synthetic text)",
                        "overrides": ["experiment=text_classifier", "max_steps=80"],
                        "quick": ["experiment=text_classifier", "max_steps=20"], "series": ("dpsgd", "bandmf b=4")},
}


def mechanism_overrides(mechanism: str) -> list[str]:
    if mechanism == "dpsgd":
        return []
    if mechanism.startswith("blt"):
        return ["privacy.mechanism=blt", f"privacy.blt_buffers={int(mechanism.split('=')[1])}"]
    return ["privacy.mechanism=bandmf", f"privacy.num_bands={int(mechanism.split('=')[1])}"]


def accuracy(job: str, quick: bool, seeds: int) -> dict:
    base = JOBS[job]["quick" if quick else "overrides"]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-bandmf-") as tmp:
        for eps in EPSILONS:
            series = JOBS[job]["series"]
            points = {m: [] for m in series}
            for seed in range(seeds):
                for m in series if seed % 2 == 0 else tuple(reversed(series)):
                    p = train_point(Path(tmp), f"{job}-{eps:g}-{m.replace(' ', '-').replace('=', '')}-{seed}",
                                    [*base, f"privacy.target_epsilon={eps}", f"seed={seed}", *mechanism_overrides(m)])
                    p["sample_rate"] = p["logged"].get("sample_rate")
                    points[m].append(p)
                    print(f"  {job} epsilon {eps:g} {m:11s} seed {seed}: eval_accuracy {p['eval_accuracy']:.3f}, "
                          f"epsilon {p['epsilon']:.3f}, sigma {p['noise_multiplier']:.3f}, q {p['sample_rate']:.3f}, "
                          f"{p['steps']} steps, {p['seconds']:.0f} s", flush=True)
            rows[f"epsilon {eps:g}"] = {"epsilon_target": eps, **{m: {
                "eval_accuracy": summarize([p["eval_accuracy"] for p in points[m]]),
                "epsilon": summarize([p["epsilon"] for p in points[m]]),
                "noise_multiplier": points[m][0]["noise_multiplier"], "sample_rate": points[m][0]["sample_rate"],
                "steps": points[m][0]["steps"]} for m in series}}
    return {"title": JOBS[job]["title"], "overrides": base, "seeds": seeds, "rows": rows}


def noise_cost(numel: int = 1 << 20, block: int = 20, repeats: int = 7) -> dict:
    """Per-step time and kept memory of the noise: DP-SGD's draw vs BandMF's at b = 4 and 16, interleaved."""
    import torch

    from workbench.privacy.blt import rational_sqrt
    from workbench.privacy.correlated import BandedNoise, BLTNoise, strategy
    from workbench.privacy.noise import GaussianNoise

    makers = {"dpsgd": lambda: GaussianNoise(1.0, 1.0, numel, rank=0, seed=1),
              "bandmf b=4": lambda: BandedNoise(strategy(4, 1000), 1.0, 1.0, numel, rank=0, seed=1),
              "bandmf b=16": lambda: BandedNoise(strategy(16, 1000), 1.0, 1.0, numel, rank=0, seed=1),
              "blt d=4": lambda: BLTNoise(rational_sqrt(4), 1.0, 1.0, numel, rank=0, seed=1)}
    noises = {k: make() for k, make in makers.items()}
    update = torch.zeros(numel)
    steps = dict.fromkeys(noises, 0)

    def run_block(k: str, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            noises[k].add_(update, steps[k])
            steps[k] += 1
        return (time.perf_counter() - t) / n

    for k in noises:  # warm-up past the ring's filling (16 steps for b = 16)
        run_block(k, 20)
    times = {k: [] for k in noises}
    for r in range(repeats):
        for k in (list(noises) if r % 2 == 0 else list(reversed(noises))):
            times[k].append(run_block(k, block))
    held = {"dpsgd": noises["dpsgd"]._buffer.numel() * noises["dpsgd"]._buffer.element_size(),
            **{k: v.memory_bytes for k, v in noises.items() if k != "dpsgd"}}
    base_t = statistics.median(times["dpsgd"])
    return {"numel": numel, "dtype": "float32", "block_steps": block, "repeats": repeats,
            "rows": {k: {"ms_per_step": statistics.median(v) * 1e3, "ms_min": min(v) * 1e3, "ms_max": max(v) * 1e3,
                         "time_ratio_to_dpsgd": statistics.median(v) / base_t, "bytes_kept": held[k],
                         "memory_ratio_to_dpsgd": held[k] / held["dpsgd"]} for k, v in times.items()}}


def workload_error_ratio(row: dict, mechanism: str) -> float:
    """sigma^2 ||A C^{-1}||_F^2 of this mechanism over DP-SGD's (C = I), at each one's calibrated sigma and the same
    steps: the total squared noise of all the iterates (the prefix sums) that the BandMF strategy minimises. Below 1,
    the correlation cancels more noise than the larger sigma adds."""
    from workbench.privacy import blt
    from workbench.privacy.correlated import prefix_sum_error, strategy

    steps = row["dpsgd"]["steps"]
    if mechanism.startswith("blt"):  # the run's own BLT: (T, k = 1 / its batch fraction, d)
        c = blt.strategy(int(mechanism.split("=")[1]), steps, round(1 / row[mechanism]["sample_rate"]))
        mine = row[mechanism]["noise_multiplier"] ** 2 * blt.prefix_sum_error(c, steps)
        return mine / (row["dpsgd"]["noise_multiplier"] ** 2 * prefix_sum_error([1.0], steps))
    b = 1 if mechanism == "dpsgd" else int(mechanism.split("=")[1])
    mine = row[mechanism]["noise_multiplier"] ** 2 * prefix_sum_error(strategy(b, steps), steps)
    return mine / (row["dpsgd"]["noise_multiplier"] ** 2 * prefix_sum_error([1.0], steps))


def render(r: dict) -> str:
    lines = ["# BandMF and BLT versus DP-SGD (`python -m benchmarks.bandmf`)", "", r["what"], "",
             f"Mode: {r['mode']}; measured {r['date']} in "
             f"{r['seconds']:.0f} s. ![figure](../docs/bandmf_vs_dpsgd.png)", ""]
    for job, j in r["jobs"].items():
        first = next(iter(j["rows"].values()))
        lines += [f"## {j['title']}: `{' '.join(j['overrides'])}`, {first['dpsgd']['steps']} steps, "
                  f"{j['seeds']} seed(s) per cell", "",
                  "| target epsilon | mechanism | eval_accuracy mean (min .. max) | epsilon | sigma | q | "
                  "minus dpsgd (mean) | iterates' noise / dpsgd's |", "|---|---|---|---|---|---|---|---|"]
        for label, row in j["rows"].items():
            for m in (m for m in MECHANISMS if m in row):
                v, a = row[m], row[m]["eval_accuracy"]
                diff = a["mean"] - row["dpsgd"]["eval_accuracy"]["mean"]
                lines.append(f"| {row['epsilon_target']:g} | {m} | {a['mean']:.3f} ({a['min']:.3f} .. {a['max']:.3f}) "
                             f"| {v['epsilon']['mean']:.3f} | {v['noise_multiplier']:.3f} | {v['sample_rate']:.3f} | "
                             f"{f'{diff:+.3f}' if m != 'dpsgd' else ''} | {workload_error_ratio(row, m):.2f} |")
        lines.append("")
    lines += ["The last column: sigma^2 ||A C^{-1}||_F^2 over DP-SGD's, A the prefix-sum matrix (the total squared noise "
              "of the iterates, what the strategy minimises), each at its calibrated sigma: below 1 the correlation "
              "cancels more noise than the larger sigma (bandmf's higher in-band rate) adds.", ""]
    n = r["noise"]
    lines += [f"## The noise's cost per step ({n['numel']} {n['dtype']} numbers, ~1M parameters; median of "
              f"{n['repeats']} interleaved blocks of {n['block_steps']} steps, one thread)", "",
              "| noise | ms / step (min .. max) | time / dpsgd | memory kept | memory / dpsgd |", "|---|---|---|---|---|"]
    for k, v in n["rows"].items():
        lines.append(f"| {k} | {v['ms_per_step']:.2f} ({v['ms_min']:.2f} .. {v['ms_max']:.2f}) | "
                     f"{v['time_ratio_to_dpsgd']:.2f}x | {v['bytes_kept'] / 2**20:.0f} MiB | "
                     f"{v['memory_ratio_to_dpsgd']:.0f}x |")
    return "\n".join(lines) + "\n"


def draw(r: dict, path: Path) -> None:
    """One panel per job: mean eval accuracy per epsilon and mechanism as bars, each seed as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = r["jobs"]
    fig, axes = plt.subplots(1, len(jobs), figsize=(6 * len(jobs), 4), squeeze=False)
    for ax, (job, j) in zip(axes[0], jobs.items()):
        rows = j["rows"]
        series = [m for m in MECHANISMS if m in next(iter(rows.values()))]
        bars_on(ax, rows, series, "{:.3f}")
        ax.set_xticks(range(len(rows)), list(rows))
        lo = min(v for row in rows.values() for m in series for v in row[m]["eval_accuracy"]["values"])
        ax.set_ylim(max(0.0, lo - 0.1), 1.02)
        ax.set_ylabel("eval_accuracy (bars: mean; dots: seeds)")
        first = next(iter(rows.values()))["dpsgd"]
        ax.set_title(f"{j['title']}\n{first['steps']} steps, same batch, {j['seeds']} seeds, delta 1e-5", fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps per run: a smoke test, not the figure")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--text", action="store_true", help="add the text_classifier panel (needs the hf extra)")
    parser.add_argument("--only", choices=list(JOBS), help="run this job alone and keep the other panels of the json "
                        "already in --out (the text panel measured apart from the digits one)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    parser.add_argument("--figure", type=Path, default=REPO / "docs" / "bandmf_vs_dpsgd.png")
    args = parser.parse_args(argv)
    set_threads()
    quiet()
    t = time.perf_counter()
    noise = noise_cost(repeats=3 if args.quick else 7)
    for k, v in noise["rows"].items():
        print(f"  noise {k}: {v['ms_per_step']:.2f} ms/step ({v['time_ratio_to_dpsgd']:.2f}x dpsgd), "
              f"{v['bytes_kept'] / 2**20:.0f} MiB kept ({v['memory_ratio_to_dpsgd']:.0f}x)", flush=True)
    kept = {}
    if args.only and (args.out / "bandmf.json").exists():
        old = json.loads((args.out / "bandmf.json").read_text())
        kept = {k: {"seeds": old["seeds"], **v} for k, v in old["jobs"].items()}
    names = [args.only] if args.only else ["digits", "text_classifier"] if args.text else ["digits"]
    jobs = {**kept, **{job: accuracy(job, args.quick, args.seeds) for job in names}}
    jobs = {job: jobs[job] for job in JOBS if job in jobs}
    r = {"what": __doc__.split("\n\n", 2)[2].strip(), "mode": "quick" if args.quick else "full", "seeds": args.seeds,
         "num_bands": BANDS, "jobs": jobs, "noise": noise, "seconds": time.perf_counter() - t,
         "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bandmf.json").write_text(json.dumps(r, indent=1) + "\n")
    (args.out / "BANDMF.md").write_text(render(r))
    draw(r, args.figure)
    print(f"wrote {args.out / 'bandmf.json'}, {args.out / 'BANDMF.md'} and {args.figure} in {r['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
