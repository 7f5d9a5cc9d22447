"""Figure 5: MLflow tracking overhead on the training loop, on the default config (digits, MLP, logging_steps=10).

``workbench.train(compose([...]))`` runs in this process with ``tracking.enabled=true`` (a fresh SQLite store in a
temporary folder) and ``tracking.enabled=false``, alternated, after one untimed warm-up run of each (which also
creates the store's tables). The figure is the wall time of ``Trainer.fit`` -- the training loop, including
whatever its step logging costs it (``log_metrics`` and epsilon, on the training thread or on a logging thread that
fit joins before it returns) -- per step; it is read by wrapping ``Trainer.fit`` at run time (workbench's code is not edited), and the on/off ratio is
the median over pairs of neighbouring runs. For diagnosis, the time spent sending queued writes to the store
(``Store.send``, or its round trip to the CLI's tracking worker process) and
``Accountant.epsilon`` while fit runs (on any thread) is summed the same way. Start-up, the final eval, checkpoint
and artifact upload are outside the loop and outside the figure. ``disable_tqdm=true`` on both sides.
The ``samples_per_second`` metric is not used: its window restarts after each log call, so it cannot see their cost.
Quick mode stops each run at 40 steps (a smoke test of the figure).

System metrics (issue 25): the same loop with tracking on both sides, MLflow's system-metrics sampler every 1 s
(``tracking.system_metrics_interval=1``) versus off (``=0``), on a job long enough for the sampler to log several
samples (``max_steps=1000``, ``logging_steps=250`` so that epsilon for the log lines stays a small, equal part of both
sides; ``tracking.log_model=false``), runs interleaved on/off, off/on, on/off after one untimed warm-up run; the
figure is the median of the pairs' loop-time ratios. Beside it, for diagnosis on a loaded machine: the ratio of
the whole ``train()`` call's wall time and of this process's CPU time over it (the sampler is a thread of this
process here, as MLflow is imported in it; a CLI job's sampler runs in its tracking worker process). Each sampled
run must have logged ``system/`` metrics (and each unsampled one none), so the row measures what it claims. Quick
mode: 300 steps, one pair, no warm-up run (a smoke test). ``python -m benchmarks.tracking --system-metrics``
re-measures this row alone into benchmarks/results.json (the figure's other rows kept) and re-writes RESULTS.md.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
from pathlib import Path

from benchmarks.common import Settings, median, set_threads


class _LoopTimers:
    """Wraps (at run time) Trainer.fit, and, while fit runs, MlflowTracker.log_many and Accountant.epsilon."""

    def __init__(self):
        from workbench import privacy, trainer
        from workbench.tracking.store import Store
        from workbench.tracking.worker import WorkerStore

        # The store's send of each queued write (metrics lines, artifacts): in this process (Store.send), or the round
        # trip to the CLI's tracking worker process (WorkerStore._call("send", ...)); the sums keep the old name.
        self.targets = [(trainer.Trainer, "fit"), (Store, "send"), (WorkerStore, "_call"),
                        (privacy.Accountant, "epsilon")]
        self.originals = {(cls, name): getattr(cls, name) for cls, name in self.targets}
        self.inside_fit = False
        self.sums = {"log_metrics": 0.0, "epsilon": 0.0, "log_metrics_calls": 0, "epsilon_calls": 0}
        self.record: list[dict] = []

    def __enter__(self):
        timers = self
        fit, send, worker_call, epsilon = (self.originals[t] for t in self.targets)

        def timed_fit(trainer):
            timers.sums = {"log_metrics": 0.0, "epsilon": 0.0, "log_metrics_calls": 0, "epsilon_calls": 0}
            timers.inside_fit = True
            t = time.perf_counter()
            try:
                steps = fit(trainer)
            finally:
                timers.inside_fit = False
            timers.record.append({"fit": time.perf_counter() - t, "steps": steps - trainer.start_step, **timers.sums})
            return steps

        def wrap(name, original, only=None):
            def wrapper(obj, *a, **k):
                if not timers.inside_fit or (only is not None and a[0] != only):
                    return original(obj, *a, **k)
                t = time.perf_counter()
                try:
                    return original(obj, *a, **k)
                finally:
                    timers.sums[name] += time.perf_counter() - t
                    timers.sums[f"{name}_calls"] += 1
            return wrapper

        self.targets[0][0].fit = timed_fit
        self.targets[1][0].send = wrap("log_metrics", send)
        self.targets[2][0]._call = wrap("log_metrics", worker_call, only="send")
        self.targets[3][0].epsilon = wrap("epsilon", epsilon)
        return self

    def __exit__(self, *exc):
        for (cls, name), original in self.originals.items():
            setattr(cls, name, original)


SYSTEM_METRIC = "system/cpu_utilization_percentage"


def system_metrics_overhead(s: Settings, log=print) -> dict:
    """Loop time with MLflow's system-metrics sampler every 1 s / without it (tracking on in both); see the docstring."""
    from mlflow import MlflowClient

    from workbench import compose, train

    set_threads()
    quick = s.mode == "quick"
    steps, pairs = (300, 1) if quick else (1000, 3)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    with _LoopTimers() as timers, tempfile.TemporaryDirectory(prefix="bench-sysmetrics-") as tmp:
        uri = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        client = MlflowClient(uri)
        order = [(x, steps) for p in range(pairs) for x in (("on", "off") if p % 2 == 0 else ("off", "on"))]
        if not quick:
            order.insert(0, ("on", 20))  # an untimed warm-up run (the store's tables, first imports)
        for i, (setting, n) in enumerate(order):
            cfg = compose([f"output_dir={Path(tmp) / f'run{i}'}", f"tracking.uri={uri}", "disable_tqdm=true",
                           "tracking.experiment_name=bench-system-metrics", "tracking.log_model=false",
                           f"tracking.system_metrics_interval={1 if setting == 'on' else 0}",
                           f"max_steps={n}", "logging_steps=250"])
            t, cpu = time.perf_counter(), time.process_time()
            with contextlib.redirect_stdout(io.StringIO()):
                result = train(cfg)
            seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
            if i == 0 and not quick:
                continue
            system = [k for k in client.get_run(result.run_id).data.metrics if k.startswith("system/")]
            samples = len(client.get_metric_history(result.run_id, SYSTEM_METRIC)) if system else 0
            # the row measures what it claims: sampled runs logged system metrics (several), the others none
            if setting == "on":
                assert SYSTEM_METRIC in system and samples >= (1 if quick else 2), (result.run_id, system, samples)
            else:
                assert not system, (result.run_id, system)
            runs[setting].append({**timers.record[-1], "train_seconds": seconds, "train_cpu_seconds": cpu, "samples": samples,
                                  "system_metrics": len(system)})
    per_step = {k: [r["fit"] / r["steps"] for r in v] for k, v in runs.items()}
    ratios = [a / b for a, b in zip(per_step["on"], per_step["off"])]
    train_ratios = [a["train_seconds"] / b["train_seconds"] for a, b in zip(runs["on"], runs["off"])]
    cpu_ratios = [a["train_cpu_seconds"] / b["train_cpu_seconds"] for a, b in zip(runs["on"], runs["off"])]
    ab, ab_train, ab_cpu = median(ratios), median(train_ratios), median(cpu_ratios)
    loop_s = median([r["fit"] for r in runs["on"] + runs["off"]])
    samples = [r["samples"] for r in runs["on"]]
    log(f"  system metrics every 1 s: loop on/off {ab - 1:+.1%} (median of {len(ratios)} pairs, "
        f"{min(ratios) - 1:+.1%} .. {max(ratios) - 1:+.1%}); whole train() {ab_train - 1:+.1%}, its process CPU time "
        f"{ab_cpu - 1:+.1%}; "
        f"{loop_s:.1f} s loops, {min(samples)}-{max(samples)} samples of {runs['on'][0]['system_metrics']} system/ "
        "metrics per sampled run")
    return {
        "config": f"default job, max_steps={steps}, logging_steps=250, tracking.log_model=false; "
                  "tracking.system_metrics_interval=1 vs 0",
        "steps": steps, "pairs": pairs, "interval_s": 1.0,
        "step_ms_sampling": median(per_step["on"]) * 1e3, "step_ms_no_sampling": median(per_step["off"]) * 1e3,
        "runs_step_ms_sampling": [x * 1e3 for x in per_step["on"]],
        "runs_step_ms_no_sampling": [x * 1e3 for x in per_step["off"]],
        "ab_sampling_vs_off": ab, "ab_pair_ratios": ratios,
        "train_seconds_ratio": ab_train, "train_pair_ratios": train_ratios,
        "train_cpu_ratio": ab_cpu, "train_cpu_pair_ratios": cpu_ratios,
        "loop_seconds_median": loop_s, "samples_per_sampled_run": samples,
        "system_metrics_logged": runs["on"][0]["system_metrics"],
    }


def tracking_overhead(s: Settings, log=print) -> dict:
    from workbench import compose, train

    set_threads()
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    with _LoopTimers() as timers, tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp:
        uri = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        i = 0
        for pair in range(s.tracking_pairs + 1):  # pair 0 is the warm-up
            for setting in (("on", "off") if pair % 2 == 0 else ("off", "on")):
                cfg = compose([f"output_dir={Path(tmp) / f'run{i}'}", f"tracking.uri={uri}", "disable_tqdm=true",
                               f"tracking.enabled={'true' if setting == 'on' else 'false'}",
                               "tracking.experiment_name=bench-tracking",
                               *(["max_steps=40"] if s.mode == "quick" else [])])  # quick: a smoke test
                i += 1
                with contextlib.redirect_stdout(io.StringIO()):
                    train(cfg)
                if pair > 0:
                    runs[setting].append(timers.record[-1])
        logging_steps, mode = cfg.logging_steps, cfg.privacy.grad_sample_mode
    steps = runs["on"][0]["steps"]
    logs = -(-steps // logging_steps)  # every logging_steps, and the last step
    per_step = {k: [r["fit"] / r["steps"] for r in v] for k, v in runs.items()}
    on, off = median(per_step["on"]), median(per_step["off"])
    pair_ratios = [a / b for a, b in zip(per_step["on"], per_step["off"])]  # run i of each setting: neighbours
    ab = median(pair_ratios)

    def per_call_ms(name, which):
        calls = sum(r[f"{name}_calls"] for r in which)
        return sum(r[name] for r in which) / max(calls, 1) * 1e3

    log_ms = per_call_ms("log_metrics", runs["on"])
    eps_ms = per_call_ms("epsilon", runs["on"] + runs["off"])
    log_share = median([r["log_metrics"] / r["fit"] for r in runs["on"]])
    eps_share = median([r["epsilon"] / r["fit"] for r in runs["on"] + runs["off"]])
    log(f"  loop step time: tracking on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms; on/off {ab - 1:+.1%} (median of "
        f"{len(pair_ratios)} pairs, {min(pair_ratios) - 1:+.1%} .. {max(pair_ratios) - 1:+.1%}); log_metrics "
        f"{log_ms:.1f} ms per call ({log_share:.1%} of the loop's wall time), epsilon {eps_ms:.0f} ms per call "
        f"({eps_share:.0%})")
    sysm = system_metrics_overhead(s, log)
    return {
        "what": __doc__.split("\n\n", 1)[1].strip(),
        "config": f"default (python -m workbench): digits, MLP 64-128-10, batch 256, DP grad_sample_mode={mode}, "
                  f"logging_steps={logging_steps}",
        "steps": steps, "log_lines": logs, "pairs": s.tracking_pairs,
        "step_ms_tracking_on": on * 1e3, "step_ms_tracking_off": off * 1e3,
        "runs_step_ms_on": [r * 1e3 for r in per_step["on"]], "runs_step_ms_off": [r * 1e3 for r in per_step["off"]],
        "ab_on_vs_off": ab, "ab_pair_ratios": pair_ratios,
        "log_metrics_ms_per_call": log_ms, "log_metrics_calls_per_run": runs["on"][0]["log_metrics_calls"],
        "log_metrics_busy_share_of_loop": log_share,
        "epsilon_ms_per_call": eps_ms, "epsilon_calls_per_run": runs["on"][0]["epsilon_calls"],
        "epsilon_busy_share_of_loop": eps_share,
        "system_metrics": sysm,
        "targets": [],  # issue 6's <= 3 % is no open issue's target; the figure stays as a no-target row
        "info": [{"what": "tracking overhead: loop time, tracking on / off - 1", "value": ab - 1, "unit": "%"},
                 {"what": "time sending queued writes to the store / loop wall time (any thread)", "value": log_share,
                  "unit": "%"},
                 {"what": "time inside Accountant.epsilon / loop wall time (any thread; on and off alike)",
                  "value": eps_share, "unit": "%"},
                 {"what": "system-metrics overhead: loop time, MLflow sampler every 1 s / off - 1 (tracking on in both)",
                  "value": sysm["ab_sampling_vs_off"] - 1, "unit": "%"}],
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.tracking --system-metrics``: re-measure the system-metrics row alone and put it into the
    tracking figure of benchmarks/results.json (its other rows kept, this row's date, git and load beside it), then
    re-write RESULTS.md."""
    import argparse
    import json
    import logging
    import os
    import warnings

    from benchmarks import report
    from benchmarks.common import REPO, dump_json, machine_info

    parser = argparse.ArgumentParser(prog="python -m benchmarks.tracking", description=main.__doc__)
    parser.add_argument("--system-metrics", action="store_true", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    s = Settings.for_mode(args.quick)
    results = json.loads((args.out / "results.json").read_text())
    fig = results["tracking_overhead"]
    if fig["mode"] != s.mode:
        parser.error(f"results.json's tracking figure is {fig['mode']} mode; this run is {s.mode}")
    machine, load = machine_info(), os.getloadavg()[0]
    sm = system_metrics_overhead(s)
    sm["measured"] = {"command": "python -m benchmarks.tracking --system-metrics" + (" --quick" if args.quick else ""),
                      "date": machine["date"], "git": machine["git"], "cpu": machine["cpu"],
                      "load_avg_1min_before": round(load, 2), "load_avg_1min_after": round(os.getloadavg()[0], 2),
                      "note": "measured in a later run than the rest of this figure (its other rows kept)"}
    fig["system_metrics"] = sm
    fig["summary"]["system_metrics_1s_vs_off"] = sm["ab_sampling_vs_off"]
    fig["info"] = [i for i in fig["info"] if not i["what"].startswith("system-metrics")] + [
        {"what": "system-metrics overhead: loop time, MLflow sampler every 1 s / off - 1 (tracking on in both)",
         "value": sm["ab_sampling_vs_off"] - 1, "unit": "%"}]
    dump_json(results, args.out / "results.json")
    first = next(iter(results.values()))
    (args.out / "RESULTS.md").write_text(report.render(results, first["mode"], first["command"], first["machine"],
                                                       sum(f["seconds"] for f in results.values())))
    print(f"wrote the system-metrics row into {args.out / 'results.json'} and {args.out / 'RESULTS.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
