"""Figure 7: the whole default job as a process -- ``python -m workbench`` (DP-SGD on digits, MLP, eps 8, 30 epochs,
PLD accounting, eval, checkpoint, MLflow run with its artifacts) -- against ``benchmarks/raw_opacus_digits.py``, the
same training written with raw Opacus and its defaults (no tracking, no checkpoint). Wall time from launch to exit,
``OMP_NUM_THREADS=1``, each in its own fresh folder; warm: one untimed run of each first (the OS file cache, the
MLflow store's tables in workbench's folder, workbench's calibration cache). Then pairs, the order alternated.
Quick mode runs 1 epoch on both sides, one pair, without the warm-up runs (a smoke test of the figure).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, Settings, median, subprocess_env, target

TARGET = 0.6  # workbench's wall time / the raw Opacus script's (issue 10)


def _timed(cmd: list[str], cwd: Path) -> float:
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - t
    if proc.returncode != 0 or "done:" not in proc.stdout:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    return seconds


def end_to_end(s: Settings, log=print) -> dict:
    epochs = 1 if s.mode == "quick" else 30
    pairs = 1 if s.mode == "quick" else 3
    commands = {"workbench": [sys.executable, "-m", "workbench", f"num_train_epochs={epochs}"],
                "raw_opacus": [sys.executable, str(REPO / "benchmarks" / "raw_opacus_digits.py"), str(epochs)]}
    runs: dict[str, list[float]] = {k: [] for k in commands}
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        folders = {k: Path(tmp) / k for k in commands}
        for folder in folders.values():
            folder.mkdir()
        for k, cmd in commands.items() if s.mode == "full" else ():  # warm-up, untimed
            _timed(cmd, folders[k])
        for i in range(pairs):
            for k in (commands if i % 2 == 0 else reversed(list(commands))):
                runs[k].append(_timed(commands[k], folders[k]))
    ratio = median(runs["workbench"]) / median(runs["raw_opacus"])
    log(f"  workbench {median(runs['workbench']):.2f} s, raw Opacus {median(runs['raw_opacus']):.2f} s: {ratio:.2f}x")
    return {
        "what": " ".join(__doc__.split()),
        "epochs": epochs, "pairs": pairs, "warm_up_runs": s.mode == "full", "wall_seconds": runs,
        "median_seconds": {k: median(v) for k, v in runs.items()}, "workbench_vs_raw_opacus": ratio,
        "targets": [target("default job wall time / raw Opacus script's (warm, whole processes)", ratio, TARGET,
                           False)],
    }
