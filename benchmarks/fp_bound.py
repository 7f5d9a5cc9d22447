"""What the floating-point bound costs (issue 19): the DP step with the certified bound beside the same step with the
clipping code from before it, on every preset, in one run.

    python -m benchmarks.fp_bound [--quick] [--before REV]   # writes benchmarks/fp_bound.json and FP_BOUND.md

``before`` is the clipping package (``workbench/privacy/clipping/``, ``workbench/clipping/`` before it moved) as it was at REV (default: the last commit before the bound), read from git and
imported under another package name; both strategies clip the same model inside the same GradientStep (the step, the
noise and the all-reduce are shared code), fed the same Poisson batches, interleaved round-robin with the order reversed
on every repeat, one thread. The ratio after / before is the bound's cost; the target is >= 0.95x.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO, Settings, interleaved, median, set_threads, timed
from benchmarks.presets import preset
from benchmarks.throughput import STEP_SHARE, Replay, plain_step, workbench_step

BEFORE = "cbfe770"  # main just before the bound landed
PACKAGE = "workbench_clipping_before"
TARGET = 0.95
LONGER = 3  # blocks this many times dp_vs_nonprivate's: the effect measured is a few percent


def load_before(rev: str, into: Path):
    """The clipping package at ``rev`` as the package ``PACKAGE`` (its own imports rewritten to it)."""
    folder = "workbench/privacy/clipping"  # before the move: workbench/clipping
    if subprocess.run(["git", "cat-file", "-e", f"{rev}:{folder}"], cwd=REPO, capture_output=True).returncode:
        folder = "workbench/clipping"
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{folder}"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    pkg = into / PACKAGE
    pkg.mkdir()
    for name in names:
        if name.endswith(".py"):
            text = subprocess.run(["git", "show", f"{rev}:{folder}/{name}"], cwd=REPO, check=True,
                                  capture_output=True, text=True).stdout
            (pkg / name).write_text(text.replace(folder.replace("/", "."), PACKAGE))
    sys.path.insert(0, str(into))
    import importlib

    return importlib.import_module(PACKAGE)


def _with_before(step, before):
    """The same GradientStep with the clipping strategy from before the bound (bk: the module stays the model)."""
    gs = step.gradient_step
    gs.clipper = before.make(gs.module, gs.params, max_grad_norm=gs.clip, mode=gs.mode)
    return step

# The presets the bound's cost was measured on (issue 17); gpt and vit (issue 21) take modes the "before" code lacks.
BOUND_PRESETS = ("mlp", "images_resnet", "text_classifier", "lm_lora", "transformer")


def run(s: Settings, rev: str) -> dict:
    set_threads()
    out = {"before": rev, "mode": s.mode, "target": TARGET, "presets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        before = load_before(rev, Path(tmp))
        for name in BOUND_PRESETS:
            p = preset(name, s.max_batch)
            batches = p.poisson_batches(16)
            fixed = p.first_examples(8)
            steps = {"non_private": plain_step(p.model(), p.criterion(reduction="none")),
                     "before": _with_before(workbench_step(p.model(), "auto", check_on=fixed,
                                                           criterion=p.criterion(reduction="none"),
                                                           expected_batch=p.batch_size), before),
                     "after": workbench_step(p.model(), "auto", check_on=fixed, criterion=p.criterion(reduction="none"),
                                             expected_batch=p.batch_size)}
            n_steps = max(2, round(LONGER * s.steps * STEP_SHARE[name]))  # longer blocks: a 5 % effect
            replays = {k: Replay(st, batches) for k, st in steps.items()}
            for r in replays.values():
                r.block(max(1, round(s.warmup_steps * STEP_SHARE[name])))
            rates = interleaved({k: (lambda r=r: timed(lambda: r.block(n_steps))) for k, r in replays.items()},
                                s.repeats)
            rate = {k: median(v) for k, v in rates.items()}
            entry = {"grad_sample_mode": steps["after"].gradient_step.mode, "batch": p.batch_size,
                     "samples_per_s": rate, "runs": rates, "after_vs_before": rate["after"] / rate["before"],
                     "after_vs_non_private": rate["after"] / rate["non_private"],
                     "before_vs_non_private": rate["before"] / rate["non_private"]}
            entry["met"] = entry["after_vs_before"] >= TARGET
            out["presets"][name] = entry
            print(f"  {name} ({entry['grad_sample_mode']}): after/before {entry['after_vs_before']:.3f}x, "
                  f"after/non-private {entry['after_vs_non_private']:.2f}x, before/non-private "
                  f"{entry['before_vs_non_private']:.2f}x", flush=True)
    return out


def render(result: dict) -> str:
    lines = ["# The floating-point bound's cost (`python -m benchmarks.fp_bound`)", "",
             __doc__.split("\n\n")[2].strip(), "",
             f"Mode: {result['mode']}; before = `{result['before']}`; target after / before >= {result['target']}x.", "",
             "| preset | mode | batch | after / before | after / non-private | before / non-private | target |",
             "|---|---|---|---|---|---|---|"]
    for name, e in result["presets"].items():
        lines.append(f"| {name} | {e['grad_sample_mode']} | {e['batch']} | {e['after_vs_before']:.3f}x | "
                     f"{e['after_vs_non_private']:.2f}x | {e['before_vs_non_private']:.2f}x | "
                     f"{'met' if e['met'] else 'missed'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--out", default=str(REPO / "benchmarks"))
    args = parser.parse_args()
    result = run(Settings.for_mode(args.quick), args.before)
    out = Path(args.out)
    (out / "fp_bound.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "FP_BOUND.md").write_text(render(result))


if __name__ == "__main__":
    main()
