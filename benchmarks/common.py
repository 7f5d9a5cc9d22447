"""What every figure shares: settings per mode, one thread per process, interleaved timing, machine info."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported anywhere in this process

import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
THREADS = 1


@dataclass(frozen=True)
class Settings:
    """How long each figure measures. ``quick`` fits CI (well under 3 minutes on 2 cores)."""

    mode: str
    warmup_steps: int  # untimed steps per configuration before the first timed block
    steps: int  # training steps per timed block
    repeats: int  # timed blocks per configuration (interleaved); the median is reported
    scaling_launches: int  # launch_distributed jobs per world size (alternated W=1, W=2, W=1, ...)
    allreduce_iters: int  # all-reduces per timed block
    accounting_repeats: int
    tracking_pairs: int  # workbench.train runs per tracking setting (on/off alternated), after one warm-up pair
    startup_runs: int  # `python -m workbench` runs per start-up variant
    max_batch: int | None  # dp_vs_nonprivate: a preset's per-device batch capped at this (None: the preset's own)

    @classmethod
    def for_mode(cls, quick: bool) -> "Settings":
        if quick:
            return cls("quick", warmup_steps=5, steps=20, repeats=3, scaling_launches=1, allreduce_iters=100,
                       accounting_repeats=1, tracking_pairs=1, startup_runs=1, max_batch=64)
        return cls("full", warmup_steps=20, steps=100, repeats=7, scaling_launches=2, allreduce_iters=500,
                   accounting_repeats=3, tracking_pairs=5, startup_runs=3, max_batch=None)


def set_threads() -> None:
    import torch

    torch.set_num_threads(THREADS)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: one thread, this checkout importable first."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONPATH": path, **extra}


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def interleaved(blocks: dict[str, Callable[[], tuple[float, float]]], repeats: int) -> dict[str, list[float]]:
    """Run each block ``repeats`` times, round-robin, reversing the order on every repeat (so a slow drift of the
    machine hits every configuration alike). A block returns (work, seconds); the result is work/second per run."""
    names = list(blocks)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            work, seconds = blocks[name]()
            out[name].append(work / seconds)
    return out


def timed(fn: Callable[[], float]) -> tuple[float, float]:
    """(work returned by fn, wall seconds)."""
    t = time.perf_counter()
    work = fn()
    return work, time.perf_counter() - t


def target(name: str, value: float, goal: float, higher_is_better: bool, unit: str = "x") -> dict:
    """A target row: met or missed, and by how much (the gap as a fraction of the goal)."""
    met = value >= goal if higher_is_better else value <= goal
    gap = (value - goal) / goal if goal else 0.0
    return {"target": name, "value": value, "goal": goal, "unit": unit,
            "comparison": ">=" if higher_is_better else "<=", "met": bool(met), "gap": gap}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "opacus", "dp-accounting", "mlflow", "hydra-core", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (out.stdout.strip() + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def machine_info() -> dict:
    import torch

    return {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "mem_gib": _mem_total_gib(),
        "platform": platform.platform(), "python": sys.version.split()[0], "versions": _versions(),
        "torch_threads": torch.get_num_threads(), "device": "cpu", "gpu": torch.cuda.is_available(),
        "load_avg_1min": round(os.getloadavg()[0], 2), "git": git_sha(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def dump_json(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
