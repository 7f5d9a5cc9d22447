"""Issue 21 side by side: on the tutorial-style ``gpt`` and ``vit`` presets (benchmarks.presets, built as
``python -m workbench`` builds them, the preset's batch 256), the non-private step, the mode ``auto`` took before
issue 21's book-keeping rules (gpt: ``vmap``; vit: ``hooks``) and ``auto`` now (``bk``), each on a fresh copy of the
model, timed in one process on the same replayed Poisson batches, interleaved (benchmarks.common.interleaved), as ratios
to the non-private step; peak step memory as benchmarks.throughput measures it.

    python -m benchmarks.issue21            # writes benchmarks/presets_gpt_vit.json (one run; the committed file
                                            # holds three, under "runs"; the four before them under
                                            # "before_bk_speed"; issue 21's two under "before_issue_24")
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(repeats: int = 5, steps: int = 5, warmup: int = 3) -> dict:
    warnings.filterwarnings("ignore")
    from benchmarks.common import interleaved, machine_info, median, set_threads, timed
    from benchmarks.presets import PRESETS, preset
    from benchmarks.throughput import Replay, peak_step_bytes, plain_step, workbench_step

    set_threads()
    out = {"what": __doc__.split("\n\n")[0], "machine": machine_info(), "repeats": repeats, "steps_per_block": steps,
           "presets": {}}
    for name, before in (("gpt", "vmap"), ("vit", "hooks")):
        p = preset(name)
        kw = dict(criterion=p.criterion(reduction="none"), expected_batch=p.batch_size,
                  max_physical_batch_size=p.cfg.max_physical_batch_size, check_on=p.first_examples(8))
        steps_of = {"non_private": plain_step(p.model(), p.criterion(reduction="none")),
                    f"before_{before}": workbench_step(p.model(), before, **kw),
                    "auto": workbench_step(p.model(), "auto", **kw)}
        mode = steps_of["auto"].gradient_step.mode
        batches, fixed = p.poisson_batches(16), p.first_examples(p.batch_size)
        replays = {k: Replay(st, batches) for k, st in steps_of.items()}
        for r in replays.values():
            r.block(warmup)
        rates = interleaved({k: (lambda r=r: timed(lambda: r.block(steps))) for k, r in replays.items()}, repeats)
        memory = {k: peak_step_bytes(lambda st=st: st(fixed, 0)) for k, st in steps_of.items()}
        base = median(rates["non_private"])
        rows = {k: {"samples_per_s": median(v), "samples_per_s_runs": v,
                    "throughput_vs_non_private": median(v) / base,
                    "peak_memory_vs_non_private": memory[k] / memory["non_private"]} for k, v in rates.items()}
        out["presets"][name] = {"what": PRESETS[name][1], "batch": p.batch_size, "auto_mode": mode,
                                "auto_note": steps_of["auto"].gradient_step.mode_note, "rows": rows}
        print(f"{name}: auto={mode}; " + ", ".join(f"{k} {v['samples_per_s']:.0f}/s ({v['throughput_vs_non_private']:.2f}x"
                                                      f", mem {v['peak_memory_vs_non_private']:.2f}x)"
                                                      for k, v in rows.items()), flush=True)
    return out


if __name__ == "__main__":
    t = time.time()
    result = main()
    result["seconds"] = time.time() - t
    path = Path(__file__).resolve().parent / "presets_gpt_vit.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
