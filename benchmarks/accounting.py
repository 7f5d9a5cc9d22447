"""Figure 4: privacy accounting time (workbench.privacy, PLD accountant, its default discretization).

Scenario: a 60,000-example dataset at expected batch 60 (q = 1e-3), delta = 1e-5, target epsilon 1.
- ``epsilon``: a fresh ``Accountant`` (nothing cached) reporting epsilon after 10k and 100k Poisson steps at sigma 1.37
  (epsilon ~ 0.29 and ~ 1.0); then, the same accountant reporting the next log line (steps + 10) from its cached
  one-step PLD, as ``Trainer.fit`` does every ``logging_steps``.
- ``calibrate``: ``calibrate_noise`` for epsilon 1 after 10k and 100k steps (from nothing; every accountant it builds
  is fresh).
- ``parallel_poisson``: ``shard=global`` with W = 2, 4, 8 ranks (quick mode: W = 2) at the same expected global
  batch (q_r = 1e-3 / W): calibration and epsilon after 10k and 100k steps.
Each time is the median of the repeats; every repeat starts from nothing.
"""

from __future__ import annotations

import time

from benchmarks.common import Settings, median

Q, DELTA, TARGET_EPS, SIGMA = 1e-3, 1e-5, 1.0, 1.37
STEPS = (10_000, 100_000)
WORLDS = (2, 4, 8)


def _time(fn) -> tuple[float, float]:
    t = time.perf_counter()
    value = fn()
    return time.perf_counter() - t, value


def accounting(s: Settings, log=print) -> dict:
    from workbench import privacy

    reps = s.accounting_repeats
    eps_rows, cal_rows, pp_rows = {}, {}, {}
    for steps in STEPS:
        first, nxt, cal = [], [], []
        for _ in range(reps):
            acc = privacy.Accountant("pld", Q, SIGMA)
            dt, eps = _time(lambda: acc.epsilon(steps, DELTA))
            first.append(dt)
            dt2, _ = _time(lambda: acc.epsilon(steps + 10, DELTA))
            nxt.append(dt2)
            dt3, sigma = _time(lambda: privacy.calibrate_noise("pld", Q, steps, TARGET_EPS, DELTA))
            cal.append(dt3)
        eps_rows[steps] = {"epsilon": eps, "noise_multiplier": SIGMA, "seconds_fresh": median(first),
                           "seconds_next_log_line": median(nxt), "runs_fresh": first}
        cal_rows[steps] = {"target_epsilon": TARGET_EPS, "noise_multiplier": sigma, "seconds": median(cal),
                           "runs": cal}
        log(f"  Poisson {steps} steps: epsilon {median(first):.3f} s (next log line {median(nxt):.3f} s), "
            f"calibration {median(cal):.3f} s (sigma {sigma:.4f})")
    for w in WORLDS if s.mode == "full" else WORLDS[:1]:
        for steps in STEPS:
            cal, ep = [], []
            for _ in range(reps):
                dt, sigma = _time(lambda: privacy.calibrate_noise("pld", Q / w, steps, TARGET_EPS, DELTA, w, "global"))
                cal.append(dt)
                acc = privacy.Accountant("pld", Q / w, sigma, w, "global")
                dt2, eps = _time(lambda: acc.epsilon(steps, DELTA))
                ep.append(dt2)
            pp_rows[f"W{w}/{steps}"] = {"world_size": w, "steps": steps, "sample_rate_per_rank": Q / w,
                                        "noise_multiplier": sigma, "epsilon": eps, "calibrate_seconds": median(cal),
                                        "epsilon_seconds": median(ep), "calibrate_runs": cal}
            log(f"  parallel Poisson W={w}, {steps} steps: calibration {median(cal):.3f} s (sigma {sigma:.4f}), "
                f"epsilon {median(ep):.3f} s")
    widest = max(v["world_size"] for v in pp_rows.values())
    return {
        "what": __doc__.split("\n\n", 1)[1].strip(),
        "sample_rate": Q, "delta": DELTA, "accountant": "pld", "repeats": reps,
        "pld_discretization": privacy.DEFAULT_PLD_DISCRETIZATION,
        "epsilon": {str(k): v for k, v in eps_rows.items()},
        "calibrate": {str(k): v for k, v in cal_rows.items()},
        "parallel_poisson": pp_rows,
        "targets": [],  # issue 6's (1 s, 5 s, 30 s) were met with 4-27x margin; no open issue sets one
        "info": [
            {"what": "epsilon of 100k Poisson steps (fresh accountant)", "value": eps_rows[100_000]["seconds_fresh"],
             "unit": "s"},
            *({"what": f"calibrate sigma, {n // 1000}k Poisson steps", "value": cal_rows[n]["seconds"], "unit": "s"}
              for n in STEPS),
            {"what": f"parallel Poisson W={widest} calibration (slowest of 10k/100k steps)",
             "value": max(pp_rows[f"W{widest}/{n}"]["calibrate_seconds"] for n in STEPS), "unit": "s"},
        ],
    }
