"""DP-AdamBC versus plain AdamW and SGD (issue 23's figure): accuracy at epsilon 1 and 8 on the embedded default job.

    python -m benchmarks.dp_adam [--quick] [--seeds N]   # writes benchmarks/dp_adam.json, DP_ADAM.md and
                                                          # docs/dp_adamw.png

Each point is ``workbench.train(compose([...]))`` on the default job (digits, MLP, DP-SGD with C=1, 30 epochs) at
``privacy.target_epsilon`` 1 and 8 (same delta, steps and sampling on every side), with three optimizers:

- ``sgd``: the default (``optimizer=sgd``, momentum 0.5) at its own ``learning_rate=1.5``;
- ``adamw``: plain ``torch.optim.AdamW`` (``optimizer=dp_adamw optimizer._target_=torch.optim.AdamW ~optimizer.gamma``:
  the same betas and eps, no bias correction);
- ``dp_adamw``: ``optimizer=dp_adamw`` (DP-AdamBC: the second moment less the noise's known variance (sigma C / B)^2).

The Adams run at five learning rates each (the default's 1.5 is SGD's): AdamW at 1e-3 .. 1e-1, DP-AdamW at 3e-5 ..
3e-3 -- its corrected second moment is far below the noise's s^2 that plain Adam divides by, so its steps are larger
at the same learning rate (earlier, narrower grids found AdamW still rising at their top and DP-AdamW falling from
1e-3 at epsilon 1). Every cell is in the table; the figure shows each optimizer at its best learning rate per
epsilon, chosen on the same eval accuracy it reports, so it is each optimizer's best case on this job, not a held-out
comparison. Seeds 0 .. N-1 (``--seeds``, 2 by default; the noise itself comes from a fresh secret per run);
tracking to a throwaway SQLite store.
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

from benchmarks.adaptive_clipping import grouped_bars, quiet, summarize, train_point
from benchmarks.common import REPO, set_threads

EPSILONS = (1.0, 8.0)
OPTIMIZERS = {
    "sgd": (["optimizer=sgd"], (1.5,)),
    "adamw": (["optimizer=dp_adamw", "optimizer._target_=torch.optim.AdamW", "~optimizer.gamma"], (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)),
    "dp_adamw": (["optimizer=dp_adamw"], (3e-5, 1e-4, 3e-4, 1e-3, 3e-3)),
}


def run(quick: bool, seeds: int) -> dict:
    set_threads()
    quiet()
    extra = ["num_train_epochs=5"] if quick else []
    cells: list[dict] = []
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-dp-adam-") as tmp:
        for eps in EPSILONS:
            for seed in range(seeds):
                for opt, (overrides, lrs) in OPTIMIZERS.items():
                    for lr in lrs:
                        p = train_point(Path(tmp), f"{opt}-{lr:g}-{eps:g}-{seed}",
                                        [*overrides, f"learning_rate={lr}", f"privacy.target_epsilon={eps}",
                                         f"seed={seed}", *extra])
                        cells.append({"optimizer": opt, "learning_rate": lr, "epsilon_target": eps, "seed": seed,
                                      **{k: p[k] for k in ("eval_accuracy", "eval_loss", "epsilon", "noise_multiplier",
                                                           "steps", "seconds")}})
                        print(f"  eps {eps:g} {opt:8s} lr {lr:g} seed {seed}: eval_accuracy {p['eval_accuracy']:.3f}, "
                              f"epsilon {p['epsilon']:.3f}, sigma {p['noise_multiplier']:.3f}, {p['steps']} steps, "
                              f"{p['seconds']:.0f} s", flush=True)
    table = {}
    for eps in EPSILONS:
        for opt, (_, lrs) in OPTIMIZERS.items():
            for lr in lrs:
                these = [c for c in cells if (c["epsilon_target"], c["optimizer"], c["learning_rate"]) == (eps, opt, lr)]
                table[f"{eps:g}/{opt}/{lr:g}"] = {
                    "epsilon_target": eps, "optimizer": opt, "learning_rate": lr,
                    "eval_accuracy": summarize([c["eval_accuracy"] for c in these]),
                    "epsilon": statistics.fmean(c["epsilon"] for c in these),
                    "noise_multiplier": these[0]["noise_multiplier"], "steps": these[0]["steps"]}
    best = {}
    for eps in EPSILONS:
        for opt in OPTIMIZERS:
            rows = [v for v in table.values() if v["epsilon_target"] == eps and v["optimizer"] == opt]
            best[f"{eps:g}/{opt}"] = max(rows, key=lambda v: v["eval_accuracy"]["mean"])
    return {"what": __doc__.split("\n\n", 2)[2].strip(), "mode": "quick" if quick else "full", "seeds": seeds,
            "overrides": extra, "table": table, "best": best, "cells": cells,
            "seconds": time.perf_counter() - t_all, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def render(r: dict) -> str:
    steps = next(iter(r["table"].values()))["steps"]
    lines = ["# DP-AdamBC versus AdamW and SGD (`python -m benchmarks.dp_adam`)", "", r["what"], "",
             f"Mode: {r['mode']}{' (' + ' '.join(r['overrides']) + ')' if r['overrides'] else ''}; {r['seeds']} seed(s) "
             f"per cell; {steps} steps; measured {r['date']} in {r['seconds']:.0f} s. "
             "![figure](../docs/dp_adamw.png)", "",
             "| target epsilon | optimizer | learning_rate | eval_accuracy mean (min .. max) | epsilon | sigma | best lr |",
             "|---|---|---|---|---|---|---|"]
    for v in r["table"].values():
        a = v["eval_accuracy"]
        is_best = r["best"][f"{v['epsilon_target']:g}/{v['optimizer']}"] is v
        lines.append(f"| {v['epsilon_target']:g} | {v['optimizer']} | {v['learning_rate']:g} | {a['mean']:.3f} "
                     f"({a['min']:.3f} .. {a['max']:.3f}) | {v['epsilon']:.3f} | {v['noise_multiplier']:.3f} | "
                     f"{'yes' if is_best else ''} |")
    return "\n".join(lines) + "\n"


def draw(r: dict, path: Path) -> None:
    rows = {f"{eps:g}": {opt: r["best"][f"{eps:g}/{opt}"] for opt in OPTIMIZERS} for eps in EPSILONS}
    labels = [f"epsilon {eps:g}\n" + "\n".join(f"{opt} lr {rows[f'{eps:g}'][opt]['learning_rate']:g}"
                                                for opt in OPTIMIZERS) for eps in EPSILONS]
    steps = next(iter(r["table"].values()))["steps"]
    grouped_bars(rows, tuple(OPTIMIZERS), path, f"default job (digits, MLP, C=1), {steps} steps, {r['seeds']} seeds: "
                 "each optimizer at its best learning rate", labels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 epochs per run: a smoke test, not the figure")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    parser.add_argument("--figure", type=Path, default=REPO / "docs" / "dp_adamw.png")
    args = parser.parse_args(argv)
    r = run(args.quick, args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dp_adam.json").write_text(json.dumps(r, indent=1) + "\n")
    (args.out / "DP_ADAM.md").write_text(render(r))
    draw(r, args.figure)
    print(f"wrote {args.out / 'dp_adam.json'}, {args.out / 'DP_ADAM.md'} and {args.figure} in {r['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
