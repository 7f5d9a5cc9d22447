"""Figure 6: start-up, seconds from launching ``python -m workbench`` (default config) to its first training step.

Each run is a fresh ``python -m workbench`` subprocess in an empty temporary working folder (so MLflow's default
store is ``./mlflow.db`` there, as for a new user), ``OMP_NUM_THREADS=1``. workbench is not edited: a
``sitecustomize`` module on ``PYTHONPATH`` (read by the interpreter at start, before ``-m workbench``) installs an
import hook that, once workbench's modules load, wraps a few of their functions to write wall-clock timestamps:
- ``imports``: ``workbench.run`` imported (torch, hydra, omegaconf, opacus validators, dp_accounting ...);
- ``build``: ``workbench.job.build`` done (config checks, data, model, noise calibration, sampler, loaders);
- ``tracker``: the MLflow run started (rank 0; ``tracking.enabled=false`` skips it);
- ``first_step``: the first ``GradientStep`` call begins (the figure), and ends;
and, inside the build, the durations of loading the data (``Digits``), ``calibrate_noise`` and the budget check
(``Accountant.max_steps``).
Variants: ``cold`` (a new store: MLflow creates its tables; an empty workbench cache: calibration, budget and data
split computed), ``warm`` (both exist: a user's second run) and, in full mode, ``tracking_off``
(``tracking.enabled=false``, an empty cache). MLflow itself runs in the job's tracking worker process (started once the
CLI has checked the config: its imports and the store overlap torch's import); ``tracker`` is when the job's run exists,
just before the first step. The job then runs to its end (the default job: 169 steps, eval, checkpoint, artifacts, the
closing figure drawn by the worker); ``process_exit`` is that whole run's wall time (full mode; quick mode stops the job
once its first step is done).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import Settings, median, subprocess_env, target

HOOK = r'''
import importlib.abc, importlib.util, json, os, sys, time

_LOG = os.environ["WORKBENCH_BENCH_STARTUP_LOG"]


def _mark(name, **extra):
    with open(_LOG, "a") as f:
        f.write(json.dumps({"event": name, "t": time.time(), **extra}) + "\n")


def _timed(owner, attr, label):
    original = getattr(owner, attr)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            _mark(label, dur=time.perf_counter() - t)

    setattr(owner, attr, wrapper)


def _patch(name, module):
    if name == "workbench.run":
        _mark("imports")
        build = module.build

        def _build(*a, **k):
            out = build(*a, **k)
            _mark("build")
            return out

        module.build = _build
    elif name == "workbench.step":
        call = module.GradientStep.__call__
        seen = []

        def __call__(self, *a, **k):
            first = not seen
            if first:
                seen.append(1)
                _mark("first_step")
            out = call(self, *a, **k)
            if first:
                _mark("first_step_done")
            return out

        module.GradientStep.__call__ = __call__
    elif name == "workbench.tracking":
        start = module.MlflowTracker.start

        def tracker_start(self, *a, **k):
            out = start(self, *a, **k)
            _mark("tracker")
            return out

        module.MlflowTracker.start = tracker_start
    elif name == "workbench.privacy.mechanism":
        _timed(module, "calibrate_noise", "calibrate_noise")
        _timed(module.Accountant, "max_steps", "budget_max_steps")
    elif name == "workbench.data":
        _timed(module.Digits, "__init__", "load_digits")


class _Finder(importlib.abc.MetaPathFinder):
    names = {"workbench.run", "workbench.step", "workbench.tracking", "workbench.privacy.mechanism", "workbench.data"}

    def find_spec(self, name, path, target=None):
        if name not in self.names:
            return None
        self.names.discard(name)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(name, module)

        loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())
'''

VARIANTS = {"cold": [], "warm": [], "tracking_off": ["tracking.enabled=false"]}
EVENTS = ("imports", "build", "tracker", "first_step", "first_step_done")
DURATIONS = ("load_digits_s", "calibrate_noise_s", "budget_max_steps_s")


def _run(workdir: Path, hook_dir: Path, extra: list[str], stop_after_first_step: bool) -> dict:
    log_path = workdir / f"startup-{time.monotonic_ns()}.jsonl"
    # the folder's own workbench cache: "cold" fills it (calibration, budget, data split), "warm" reuses it
    env = subprocess_env(WORKBENCH_BENCH_STARTUP_LOG=str(log_path), WORKBENCH_CACHE_DIR=str(workdir / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(hook_dir), env["PYTHONPATH"]])
    cmd = [sys.executable, "-m", "workbench", *extra]
    with tempfile.TemporaryFile("w+") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        stopped = False
        while proc.poll() is None:
            if time.time() - t0 > 600:
                proc.kill()
                raise RuntimeError(f"{' '.join(cmd)} ran past 600 s")
            if stop_after_first_step and log_path.exists() and "first_step_done" in log_path.read_text():
                proc.terminate()  # quick mode: the figure is in; the rest of the job is not needed
                proc.wait()
                stopped = True
                break
            time.sleep(0.02)
        total = time.time() - t0
        if not stopped and proc.returncode != 0:
            out.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {out.read()[-2000:]}")
    marks: dict[str, float] = {}
    for line in log_path.read_text().splitlines():
        e = json.loads(line)
        if "dur" in e:  # a duration inside the build: summed over calls (train and eval data, ...)
            marks[f"{e['event']}_s"] = marks.get(f"{e['event']}_s", 0.0) + e["dur"]
        else:
            marks.setdefault(e["event"], e["t"] - t0)
    missing = {"imports", "build", "first_step"} - set(marks)
    if missing:
        raise RuntimeError(f"start-up hook saw no {sorted(missing)}; is workbench importable from {hook_dir}?")
    if not stopped:
        marks["process_exit"] = total
    return marks


def startup(s: Settings, log=print) -> dict:
    runs: dict[str, list[dict]] = {k: [] for k in VARIANTS if s.mode == "full" or k != "tracking_off"}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        hook_dir = Path(tmp) / "hook"
        hook_dir.mkdir()
        (hook_dir / "sitecustomize.py").write_text(HOOK)
        for i in range(s.startup_runs):
            for variant in (("cold", "warm", "tracking_off") if i % 2 == 0 else ("tracking_off", "cold", "warm")):
                if variant not in runs:
                    continue
                work = Path(tmp) / f"{'off' if variant == 'tracking_off' else 'store'}-{i}"
                work.mkdir(exist_ok=True)  # "warm" reruns in the folder whose store "cold" just created
                runs[variant].append(_run(work, hook_dir, VARIANTS[variant], stop_after_first_step=s.mode == "quick"))
    rows = {}
    for variant, rs in runs.items():
        row = {e: median([r[e] for r in rs]) for e in (*EVENTS, *DURATIONS, "process_exit") if all(e in r for r in rs)}
        row["runs_first_step_s"] = [r["first_step"] for r in rs]
        rows[variant] = row
        log(f"  {variant}: first step at {row['first_step']:.2f} s (imports {row['imports']:.2f} s, build "
            f"{row['build']:.2f} s" + (f", MLflow run started {row['tracker']:.2f} s" if "tracker" in row else "")
            + f"; inside build: data {row.get('load_digits_s', 0):.2f} s, noise calibration "
            f"{row.get('calibrate_noise_s', 0):.2f} s, budget check {row.get('budget_max_steps_s', 0):.2f} s)"
            + (f", process exit {row['process_exit']:.2f} s" if "process_exit" in row else ""))
    return {
        "what": __doc__.split("\n\n", 1)[1].strip(),
        "workbench_command": "python -m workbench",
        "runs_per_variant": s.startup_runs,
        "variants": rows,
        "targets": [target("start-up to first step, warm (python -m workbench, default job)",
                           rows["warm"]["first_step"], 3.0, False, "s")],
        "info": [{"what": f"start-up to first step, {k} ({' '.join(VARIANTS[k]) or 'default'})",
                  "value": v["first_step"], "unit": "s"} for k, v in rows.items()],
    }
