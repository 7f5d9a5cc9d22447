"""Candidate fixes for workbench, measured side by side with the code as it is (not used by workbench itself).

    python -m benchmarks.candidates [--quick]

Each candidate is a drop-in subclass or patch applied at run time in this process only; the printed table compares it
with the current code in the same run (interleaved, medians), so the lead can decide whether to port it.

- ``eps_bounds_cache``: ``dp_accounting.pld.common.compute_self_convolve_bounds`` computes the 40 Chernoff-bound
  log-MGFs of the one-step PMF in one vectorised ``logsumexp`` and caches them per PMF array: they do not depend on
  the number of steps, yet dp_accounting recomputes them (40 scipy calls) on every ``self_compose``, i.e. for every
  log line's epsilon. Same bounds, same epsilon. Measured per epsilon call and on the default job's training loop.
- ``mallopt``: glibc's malloc hands every freed block above its (dynamic) mmap threshold back to the kernel, so the
  ~10 MB per-sample-gradient tensors of every step are page-faulted in afresh. ``mallopt(M_MMAP_THRESHOLD, 32 MiB)``
  (fixed: no dynamic threshold) + ``mallopt(M_TRIM_THRESHOLD, 1 GiB)`` once at start keeps them in the heap. Process
  wide, so measured with child processes alternating off/on, each timing every configuration interleaved.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from benchmarks.common import Settings, interleaved, median, set_threads, timed


_bounds_cache: dict = {}


def cached_self_convolve_bounds(input_list, num_times, tail_mass_truncation=0, orders=None):
    """dp_accounting's compute_self_convolve_bounds, the log-MGFs vectorised and cached per input array."""
    from scipy import special

    upper_bound = (len(input_list) - 1) * num_times
    lower_bound = 0
    if tail_mass_truncation == 0:
        return lower_bound, upper_bound
    key = id(input_list)
    hit = _bounds_cache.get(key)
    if orders is not None or hit is None or hit[0] is not input_list:
        o = (np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / len(input_list)) if orders is None \
            else np.asarray(orders, dtype=float)
        log_mgfs = special.logsumexp(np.outer(o, np.arange(len(input_list))), b=input_list, axis=1)
        hit = (input_list, o, log_mgfs)
        if orders is None:
            _bounds_cache[key] = hit  # keeps input_list alive, so its id is not reused while cached
    _, o, log_mgfs = hit
    for order, log_mgf_value in zip(o, log_mgfs):
        bound = (num_times * log_mgf_value + math.log(2 / tail_mass_truncation)) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper_bound = min(upper_bound, math.ceil(bound))
        if order < 0:
            lower_bound = max(lower_bound, math.floor(bound))
    return lower_bound, upper_bound


def set_malloc_keep() -> bool:
    """The ``mallopt`` candidate: keep freed blocks up to 32 MiB in the heap, trim only above 1 GiB (glibc only)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 * 2**20)) and bool(libc.mallopt(m_trim_threshold, 2**30))
    except (OSError, AttributeError):
        return False


def _malloc_child(setting: str, s: Settings) -> dict:
    import json

    from benchmarks import throughput as T
    from benchmarks.presets import preset

    applied = set_malloc_keep() if setting == "on" else False
    set_threads()
    replays, steps = {}, {}
    for model_name, modes in (("mlp", (None, "hooks", "ew", "bk")), ("cnn", (None, "hooks", "ew"))):
        batches = preset(model_name).poisson_batches(64)
        for mode in modes:
            key = f"{model_name}/{mode or 'non_private'}"
            step = T.plain_step(T.make_model(model_name)) if mode is None else T.workbench_step(T.make_model(model_name), mode)
            replays[key] = T.Replay(step, batches)
            steps[key] = s.steps if model_name == "mlp" else max(5, s.steps // 2)
    for r in replays.values():
        r.block(s.warmup_steps)
    rates = interleaved({k: (lambda r=r, k=k: timed(lambda: r.block(steps[k]))) for k, r in replays.items()},
                        s.repeats)
    print(json.dumps({"applied": applied, "rates": {k: median(v) for k, v in rates.items()}}))
    return rates


def _malloc_compare(s: Settings) -> None:
    import json
    import subprocess
    import sys

    from benchmarks.common import REPO, subprocess_env

    out: dict[str, list[dict]] = {"off": [], "on": []}
    for i in range(2 if s.mode == "quick" else 3):
        for setting in (("off", "on") if i % 2 == 0 else ("on", "off")):
            cmd = [sys.executable, "-m", "benchmarks.candidates", "--malloc-child", setting]
            if s.mode == "quick":
                cmd.append("--quick")
            proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, check=True)
            out[setting].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"mallopt: samples/s per configuration, median over {len(out['on'])} child processes per setting "
          f"(applied: {all(r['applied'] for r in out['on'])})")
    for key in out["off"][0]["rates"]:
        off = median([r["rates"][key] for r in out["off"]])
        on = median([r["rates"][key] for r in out["on"]])
        print(f"  {key:18s} off {off:10,.0f}  on {on:10,.0f}  on/off {on / off:.2f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.candidates")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--malloc-child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    s = Settings.for_mode(args.quick)
    if args.malloc_child:
        _malloc_child(args.malloc_child, s)
        return 0
    set_threads()
    print("eps_bounds_cache: ms per log line (epsilon at steps 10, 20, ..., 160), default config q=256/1437")
    from dp_accounting.pld import common

    from workbench import privacy

    stock = common.compute_self_convolve_bounds
    sigma = privacy.calibrate_noise("pld", 256 / 1437, 169, 8.0, 1e-5)
    res: dict[str, list[float]] = {"current": [], "eps_bounds_cache": []}
    values = {}
    for _ in range(s.accounting_repeats + 1):
        for name, fn in (("current", stock), ("eps_bounds_cache", cached_self_convolve_bounds)):
            common.compute_self_convolve_bounds = fn
            try:
                acc = privacy.Accountant("pld", 256 / 1437, sigma)
                acc.epsilon(1, 1e-5)
                t = time.perf_counter()
                values[name] = [acc.epsilon(k, 1e-5) for k in range(10, 170, 10)]
                res[name].append((time.perf_counter() - t) / 16 * 1e3)
            finally:
                common.compute_self_convolve_bounds = stock
    for k, v in res.items():
        print(f"  {k:20s} {median(v):7.1f} ms per log line")
    print(f"  same epsilons: {values['current'] == values['eps_bounds_cache']}; speed-up "
          f"{median(res['current']) / median(res['eps_bounds_cache']):.2f}x")
    _loop_with_bounds_cache(s)
    _malloc_compare(s)
    return 0


def _loop_with_bounds_cache(s: Settings) -> None:
    """The default job's training loop (Trainer.fit wall time, tracking off), current vs eps_bounds_cache."""
    import contextlib
    import io
    import tempfile
    from pathlib import Path

    from dp_accounting.pld import common

    from benchmarks.tracking import _LoopTimers
    from workbench import compose, train

    stock = common.compute_self_convolve_bounds
    per_step: dict[str, list[float]] = {"current": [], "eps_bounds_cache": []}
    with _LoopTimers() as timers, tempfile.TemporaryDirectory() as tmp:
        for pair in range(max(2, s.tracking_pairs) + 1):
            for name in (("current", "eps_bounds_cache") if pair % 2 == 0 else ("eps_bounds_cache", "current")):
                common.compute_self_convolve_bounds = stock if name == "current" else cached_self_convolve_bounds
                try:
                    cfg = compose([f"output_dir={Path(tmp) / f'{name}{pair}'}", "tracking.enabled=false",
                                   "disable_tqdm=true"])
                    with contextlib.redirect_stdout(io.StringIO()):
                        train(cfg)
                finally:
                    common.compute_self_convolve_bounds = stock
                if pair:
                    r = timers.record[-1]
                    per_step[name].append(r["fit"] / r["steps"] * 1e3)
    print("  default job's loop (Trainer.fit, tracking off), ms per step: "
          + ", ".join(f"{k} {median(v):.2f}" for k, v in per_step.items())
          + f"; current / candidate {median(per_step['current']) / median(per_step['eps_bounds_cache']):.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
