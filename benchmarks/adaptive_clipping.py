"""Adaptive clipping versus a fixed C (issue 23's figure): accuracy when C is set 10x too small, well tuned and 10x
too large, on the embedded default job.

    python -m benchmarks.adaptive_clipping [--quick] [--seeds N]   # writes benchmarks/adaptive_clipping.json,
                                                                    # ADAPTIVE_CLIPPING.md and docs/adaptive_clipping.png

Each point is ``workbench.train(compose([...]))`` on the default job (digits, MLP, DP-SGD, epsilon 8, 30 epochs,
learning_rate 1.5) with ``privacy.max_grad_norm=C`` for C in 0.1, 1 (the default's own C, taken as the well-tuned one)
and 10, once with ``privacy.clipping=fixed`` and once with ``privacy.clipping=adaptive`` started from the same C (its
defaults: target_quantile 0.5, clip_learning_rate 0.2, clip_count_noise = expected batch / 20). The target epsilon,
delta, steps and everything else are the same on both sides: adaptive raises the gradient's noise so that the total
privacy equals the fixed-C run's. Seeds 0 .. N-1 (``--seeds``, 3 by default; the noise itself comes from a fresh
secret per run). Tracking goes to a throwaway SQLite store, from which the C each adaptive run ended with is read.
Accuracy is not speed: this figure is not a ratio of timings and is not affected by the machine's load.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
import io
import json
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks.common import REPO, set_threads

C_VALUES = {"10x too small": 0.1, "well tuned": 1.0, "10x too large": 10.0}
CLIPPINGS = ("fixed", "adaptive")


def quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("mlflow", "alembic", "workbench"):
        logging.getLogger(name).setLevel(logging.ERROR)


def train_point(tmp: Path, name: str, overrides: list[str]) -> dict:
    """One short job in this process, tracked to a throwaway store under `tmp`: its eval accuracy, epsilon and the
    run's last logged metrics."""
    from mlflow import MlflowClient

    from workbench import compose, train

    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    cfg = compose([f"output_dir={tmp / name}", f"tracking.uri={uri}", "disable_tqdm=true",
                   "tracking.experiment_name=bench-accuracy", "tracking.log_model=false",
                   "tracking.log_checkpoints=false", "tracking.system_metrics_interval=0", *overrides])
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        result = train(cfg)
    seconds = time.perf_counter() - t
    logged = MlflowClient(uri).get_run(result.run_id).data.metrics
    return {"eval_accuracy": result.metrics["eval_accuracy"], "eval_loss": result.metrics.get("eval_loss"),
            "epsilon": result.epsilon, "delta": result.delta, "noise_multiplier": result.noise_multiplier,
            "steps": result.steps, "seconds": seconds, "logged": logged}


def summarize(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "values": values}


def run(quick: bool, seeds: int) -> dict:
    set_threads()
    quiet()
    extra = ["num_train_epochs=5"] if quick else []
    points: dict[str, dict[str, list[dict]]] = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-adaptive-") as tmp:
        for label, c in C_VALUES.items():
            points[label] = {k: [] for k in CLIPPINGS}
            for seed in range(seeds):
                for clipping in CLIPPINGS if seed % 2 == 0 else reversed(CLIPPINGS):
                    p = train_point(Path(tmp), f"{label}-{clipping}-{seed}".replace(" ", "_"),
                                    [f"privacy.max_grad_norm={c}", f"privacy.clipping={clipping}", f"seed={seed}",
                                     *extra])
                    p["final_clip_norm"] = p["logged"].get("clip_norm") if clipping == "adaptive" else c
                    p["gradient_noise_multiplier"] = p["logged"].get("gradient_noise_multiplier", p["noise_multiplier"])
                    points[label][clipping].append(p)
                    print(f"  C={c:g} ({label}) {clipping:8s} seed {seed}: eval_accuracy {p['eval_accuracy']:.3f}, "
                          f"epsilon {p['epsilon']:.3f}, final C {p['final_clip_norm']:.3g}, "
                          f"sigma {p['noise_multiplier']:.3f} (gradient {p['gradient_noise_multiplier']:.3f}), "
                          f"{p['steps']} steps, {p['seconds']:.0f} s", flush=True)
    rows = {}
    for label, c in C_VALUES.items():
        rows[label] = {"C": c, **{k: {
            "eval_accuracy": summarize([p["eval_accuracy"] for p in points[label][k]]),
            "epsilon": summarize([p["epsilon"] for p in points[label][k]]),
            "final_clip_norm": summarize([p["final_clip_norm"] for p in points[label][k]]),
            "noise_multiplier": points[label][k][0]["noise_multiplier"],
            "gradient_noise_multiplier": points[label][k][0]["gradient_noise_multiplier"],
            "steps": points[label][k][0]["steps"]} for k in CLIPPINGS}}
    return {"what": __doc__.split("\n\n", 2)[2].strip(), "mode": "quick" if quick else "full", "seeds": seeds,
            "overrides": extra, "rows": rows, "seconds": time.perf_counter() - t_all,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def render(r: dict) -> str:
    first = next(iter(r["rows"].values()))["fixed"]
    lines = ["# Adaptive clipping versus a fixed C (`python -m benchmarks.adaptive_clipping`)", "", r["what"], "",
             f"Mode: {r['mode']}{' (' + ' '.join(r['overrides']) + ')' if r['overrides'] else ''}; {r['seeds']} seed(s) "
             f"per cell; {first['steps']} steps; measured {r['date']} in {r['seconds']:.0f} s. "
             "![figure](../docs/adaptive_clipping.png)", "",
             "| C | clipping | eval_accuracy mean (min .. max) | epsilon | C at the end (mean) | sigma: total (gradient's) |",
             "|---|---|---|---|---|---|"]
    for label, row in r["rows"].items():
        for k in CLIPPINGS:
            v = row[k]
            a = v["eval_accuracy"]
            lines.append(f"| {row['C']:g} ({label}) | {k} | {a['mean']:.3f} ({a['min']:.3f} .. {a['max']:.3f}) | "
                         f"{v['epsilon']['mean']:.3f} | {v['final_clip_norm']['mean']:.3g} | "
                         f"{v['noise_multiplier']:.3f} ({v['gradient_noise_multiplier']:.3f}) |")
    return "\n".join(lines) + "\n"


def draw(r: dict, path: Path, title: str) -> None:
    grouped_bars(r["rows"], CLIPPINGS, path, title, [f"C={row['C']:g}\n{label}" for label, row in r["rows"].items()])


def bars_on(ax, rows: dict, series, fmt: str) -> None:
    """On ``ax``: each row's mean eval accuracy per series as a bar (labelled with ``fmt``), each seed as a dot."""
    width = 0.8 / len(series)
    for j, k in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(rows))]
        means = [row[k]["eval_accuracy"]["mean"] for row in rows.values()]
        ax.bar(xs, means, width, label=k)
        for x, row in zip(xs, rows.values()):
            vals = row[k]["eval_accuracy"]["values"]
            ax.plot([x] * len(vals), vals, "k.", markersize=4)
        for x, m in zip(xs, means):
            ax.annotate(fmt.format(m), (x, m), ha="center", va="bottom", fontsize=7)


def grouped_bars(rows: dict, series: tuple[str, ...], path: Path, title: str, xlabels: list[str]) -> None:
    """Mean eval accuracy per (row, series) as bars, each seed as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bars_on(ax, rows, series, "{:.2f}")
    ax.set_xticks(range(len(rows)), xlabels)
    ax.set_ylabel("eval_accuracy (bars: mean; dots: seeds)")
    ax.set_ylim(0, 1.15)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper center", ncol=len(series))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 epochs per run: a smoke test, not the figure")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    parser.add_argument("--figure", type=Path, default=REPO / "docs" / "adaptive_clipping.png")
    args = parser.parse_args(argv)
    r = run(args.quick, args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adaptive_clipping.json").write_text(json.dumps(r, indent=1) + "\n")
    (args.out / "ADAPTIVE_CLIPPING.md").write_text(render(r))
    first = next(iter(r["rows"].values()))["fixed"]
    draw(r, args.figure, f"default job (digits, MLP, DP-SGD), epsilon {first['epsilon']['mean']:.0f}, "
                         f"{first['steps']} steps, {r['seeds']} seeds: fixed C vs adaptive from the same C")
    print(f"wrote {args.out / 'adaptive_clipping.json'}, {args.out / 'ADAPTIVE_CLIPPING.md'} and {args.figure} "
          f"in {r['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
