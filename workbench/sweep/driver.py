"""The sweep's driver side: the parent run made before any point starts, each point's draw and config, the point
that ends last, and Hydra's callback (workbench/sweep/__init__.py says who the driver is)."""
from __future__ import annotations

import atexit
import json
import logging
import os
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from workbench import config
from workbench.errors import WorkbenchError
from workbench.privacy.accounting.tuning import TRIALS, _tnb_pmf
from workbench.sweep.summary import PENDING_TAG, TERMINAL, _varied_keys, end_parent, summarise
from workbench.tracking.runs import NOTE_TAG, PARENT_TAG, SWEEP_FILE, SWEEP_TAG, git_sha, source_tags
from workbench.tracking.tracker import MlflowTracker

log = logging.getLogger("workbench")

TUNINGS = ("all", "random_stopping")
def draw_trials(s: DictConfig | Any, rng: random.Random) -> int:
    """K, the number of trials of a random-stopping sweep."""
    if s.trials == "poisson":
        return int(np.random.default_rng(rng.getrandbits(63)).poisson(s.poisson_mean))
    u, k, cdf = rng.random(), 0, 0.0
    while cdf < u and k < 100_000:
        k += 1
        cdf += _tnb_pmf(k, s.tnb_eta, s.tnb_gamma)
    return k


# ------------------------------------------------------------------------------------------------ driver side


def check(s: DictConfig) -> None:
    if s.tuning not in TUNINGS:
        raise WorkbenchError(f"sweep.tuning={s.tuning!r} is unknown; choose one of {', '.join(TUNINGS)}")
    if s.trials not in TRIALS:
        raise WorkbenchError(f"sweep.trials={s.trials!r} is unknown; choose one of {', '.join(TRIALS)}")
    if not s.poisson_mean >= 1:  # Theorem 6's log(mu) term is negative below 1 (config.validate says why)
        raise WorkbenchError(f"sweep.poisson_mean must be >= 1, got {s.poisson_mean}")
    if not (s.tnb_eta > -1 and 0 < s.tnb_gamma < 1):
        raise WorkbenchError(f"sweep.tnb_eta must be > -1 and sweep.tnb_gamma in (0, 1), got {s.tnb_eta}, {s.tnb_gamma}")
    for metric, mode in s.metrics.items():
        if mode not in ("max", "min"):
            raise WorkbenchError(f"sweep.metrics.{metric}={mode!r}: choose max or min")


def _write(path: Path, state: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def read_state(sweep_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(sweep_dir) / SWEEP_FILE).read_text())
    except (OSError, ValueError):
        return None


def start(cfg: DictConfig, sweep_dir: str | Path, points: Sequence[Sequence[str]] = (),
          compose_point: Callable[[Sequence[str]], DictConfig] | None = None) -> dict:
    """Make the sweep's parent run (initialising the store first) and write it to the sweep folder. With
    random stopping, also draw how many times each of the `points` (their overrides) is trained (``trials``) and
    record what every point would spend (``candidates``, from its config composed by `compose_point`, default
    :func:`workbench.compose`): the bound for publishing the best needs all of them, drawn or not."""
    s = cfg.sweep
    check(s)
    configs: list[DictConfig | Exception] = []
    if s.tuning == "random_stopping":  # refused before anything is made: independent trials (config.py says why)
        config.check_trial_streams(cfg)
        if compose_point is None:
            from workbench.api import compose as compose_point
        for point in points:
            try:
                configs.append(compose_point(point))
            except Exception as e:  # noqa: BLE001 - recorded as that candidate's error below
                configs.append(e)
            if isinstance(configs[-1], DictConfig):
                config.check_trial_streams(configs[-1])
    sweep_dir = Path(sweep_dir).resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"sweep": OmegaConf.to_container(s, resolve=True), "parent_run_id": None}
    if s.tuning == "random_stopping" and points:
        state["trials"] = draw(s, len(points))
        state["varies"] = _varied_keys(points)
        state["candidates"] = [{"overrides": " ".join(p), **_candidate(c)} for p, c in zip(points, configs)]
    if cfg.tracking.enabled:
        tracker = MlflowTracker(cfg)
        experiment_id = tracker._experiment_id()  # pylint: disable=protected-access
        name = f"sweep {sweep_dir.parent.name}/{sweep_dir.name}"
        # RUNNING from the sweep's start until its last point has ended (summary.end_parent), like the sweep itself.
        run = tracker.client.create_run(experiment_id, run_name=name,
                                        tags={SWEEP_TAG: str(sweep_dir), "workbench.role": "sweep",
                                              **source_tags("inline", git_sha()),
                                              NOTE_TAG: f"sweep of {len(points) or 'its'} points in {sweep_dir}"})
        state.update(parent_run_id=run.info.run_id, tracking_uri=tracker.uri)
    _write(sweep_dir / SWEEP_FILE, state)
    return state


def draw(s: DictConfig | Any, points: int) -> list[int]:
    """How many times each of `points` points is trained under random stopping: K trials, each a uniform point."""
    rng = random.Random(s.seed) if s.seed is not None else random.SystemRandom()
    picks = [rng.randrange(points) for _ in range(draw_trials(s, rng))]
    return [picks.count(i) for i in range(points)]


def _candidate(cfg: DictConfig | Exception) -> dict:
    """A point's mechanism from its config, before anything trains (workbench.job.planned_mechanism); a point that
    cannot be composed or built is recorded with the reason: the bound cannot cover it."""
    from workbench.job import planned_mechanism

    try:
        if isinstance(cfg, Exception):
            raise cfg
        return planned_mechanism(cfg)
    except Exception as e:  # noqa: BLE001 - never a crash of the sweep: an unbounded point makes the bound infinite
        return {"error": " ".join(f"{'' if isinstance(e, WorkbenchError) else type(e).__name__ + ': '}{e}".split())[:300]}


def trials_for_point(sweep_dir: str | Path, point: int) -> int:
    """How many times point number `point` is trained: 1, or under random stopping the number drawn for it."""
    state = read_state(sweep_dir) or {}
    trials = state.get("trials")
    return 1 if trials is None else trials[point]


def point_configs(cfg: DictConfig):
    """The configs a Hydra job trains: its own, or under random stopping one per trial drawn for its point (none if
    the draw skipped it; each trial in its own folder, with fresh randomness)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except ValueError:
        yield cfg
        return
    if hc.mode != RunMode.MULTIRUN or (read_state(Path(hc.sweep.dir).resolve()) or {}).get("trials") is None:
        yield cfg
        return
    count = trials_for_point(Path(hc.sweep.dir).resolve(), int(hc.job.num))
    if count == 0:
        print(f"point {hc.job.num} ({' '.join(hc.overrides.task)}) was not drawn by random stopping: not trained",
              flush=True)
    for i in range(count):
        trial = cfg.copy()
        with open_dict(trial):
            trial.output_dir = str(Path(hc.runtime.output_dir) / f"trial-{i}")
            trial.tracking.tags["trial"] = str(i)
        yield trial


class _Lock:
    """An exclusive lock on a file in the sweep folder: one summary, even when the last points end together."""

    def __init__(self, sweep_dir: str | Path):
        self.path = Path(sweep_dir) / ".workbench-sweep.lock"

    def __enter__(self):
        import fcntl

        self.file = open(self.path, "a")
        fcntl.flock(self.file, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        self.file.close()


def _children(client, parent_run_id: str):
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    return client.search_runs([experiment_id], f"tags.`{PARENT_TAG}` = '{parent_run_id}'", max_results=50_000)


def finish(sweep_dir: str | Path) -> dict | None:
    """The driver's end: summarise now if every point has ended, else leave the summary to the last point."""
    state = read_state(sweep_dir)
    if not state or not state.get("parent_run_id"):
        return None
    from workbench.tracking.store import _retry

    tracker = _parent_tracker(state)
    with _Lock(sweep_dir):
        children = _retry(lambda: _children(tracker.client, state["parent_run_id"]))
        running = [c for c in children if c.info.status not in TERMINAL]
        if running:
            tracker.set_tags({PENDING_TAG: len(running)})
            print(f"sweep: {len(running)} of {len(children)} points still running; the last to end summarises the "
                  f"sweep on parent run_id={state['parent_run_id']}", flush=True)
            return None
        return summarise(tracker, state)


def point_ended(sweep_dir: str | Path) -> dict | None:
    """A point's end: when the driver has left and this was the last point running, summarise the sweep."""
    state = read_state(sweep_dir)
    if not state or not state.get("parent_run_id"):
        return None
    from workbench.tracking.store import _retry

    tracker = _parent_tracker(state)
    with _Lock(sweep_dir):
        if PENDING_TAG not in _retry(lambda: tracker.client.get_run(state["parent_run_id"])).data.tags:
            return None  # the driver is still there (it summarises), or the summary is done
        children = _retry(lambda: _children(tracker.client, state["parent_run_id"]))
        if any(c.info.status not in TERMINAL for c in children):
            return None
        return summarise(tracker, state)


def job_ended(cfg: DictConfig) -> None:
    """The job-end hook the launchers pass to ``train`` (workbench/launch.py, explore.sweep): a point of a sweep whose
    driver has left summarises the sweep if it was the last running; never fails the run."""
    sweep_dir = cfg.tracking.sweep_dir
    if not sweep_dir:
        return
    try:
        point_ended(sweep_dir)
    except Exception as e:  # noqa: BLE001
        log.warning("could not summarise the sweep in %s: %s", sweep_dir, e)


def _parent_tracker(state: dict) -> MlflowTracker:
    cfg = OmegaConf.create({"tracking": {"uri": state["tracking_uri"], "experiment_name": ""}})
    tracker = MlflowTracker(cfg)
    tracker.run_id = state["parent_run_id"]
    return tracker


class SweepCallback(Callback):
    """Hydra callback (registered in conf/config.yaml): runs in the multirun driver, before and after all points."""

    def __init__(self):
        self.sweep_dir: Path | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        start(config, self.sweep_dir, points=_grid(config), compose_point=lambda point: _job_config(config, point))
        atexit.register(self._end)  # a point that fails the sweep (sys.exit, exception) still gets its summary

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._end()

    def _end(self) -> None:
        if self.sweep_dir is not None:
            atexit.unregister(self._end)
            sweep_dir, self.sweep_dir = self.sweep_dir, None
            try:
                finish(sweep_dir)
            except Exception as e:  # noqa: BLE001 - a summary that fails must not turn a finished sweep into a failed one
                log.warning("could not summarise the sweep in %s: %s", sweep_dir, e)
                _end_parent_anyway(sweep_dir)


def _end_parent_anyway(sweep_dir: str | Path) -> None:
    """The summary failed: the parent still ends (never left RUNNING once its points have)."""
    state = read_state(sweep_dir)
    try:
        if state and state.get("parent_run_id"):
            tracker = _parent_tracker(state)
            children = _children(tracker.client, state["parent_run_id"])
            if all(c.info.status in TERMINAL for c in children):
                end_parent(tracker.client, state["parent_run_id"], children, failed=True)
    except Exception as e:  # noqa: BLE001
        log.warning("could not end the sweep's parent run: %s", e)


def _job_config(config: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """The config Hydra's launcher gives the job with these overrides (its own loader: the driver's Hydra stays as
    it is), as workbench.compose returns it."""
    from hydra.core.global_hydra import GlobalHydra

    from workbench import overrides as overrides_

    cfg = GlobalHydra.instance().config_loader().load_sweep_config(config, list(overrides))
    overrides_.record_choices(cfg, cfg.hydra.runtime.choices, list(cfg.hydra.overrides.task))  # the keys typed, too
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _grid(config: DictConfig) -> list[list[str]]:
    """The jobs (their overrides, in job-number order) Hydra's basic sweeper makes of the command line."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
