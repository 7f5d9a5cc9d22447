"""Multirun sweeps: one parent run, made by the driver before any point starts; a summary on it once the last point has
ended (table, frontier, best point per metric, counts); and what the sweep costs in privacy.

The driver is whatever runs the points: Hydra calls :class:`SweepCallback` (``hydra.callbacks`` in conf/config.yaml)
in its own process for every launcher (basic, submitit plugin; points that use ``launcher=local|slurm`` submit from
there too); :func:`workbench.explore.sweep` calls :func:`start` and :func:`finish` itself. The driver writes the parent
run id to ``<sweep dir>/.workbench-sweep.json``; points read it (:func:`workbench.tracking.runs.sweep_parent`) and never
make a parent. When the driver ends before its points (``launcher.wait=false``) the last point to end summarises.

What a sweep costs, every point having trained on the same private data (add-or-remove-one neighbours):

- ``sweep_epsilon_all``: publishing every point. The PLD composition of all children's DP events (each child's q,
  sigma, steps, W, shard: :meth:`workbench.privacy.Accountant.pld`), at the smallest delta of the children.
- ``sweep_epsilon_best`` (``sweep.tuning=random_stopping``): publishing only the best of K trials, each a uniformly
  drawn point, K random. Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022:
  Theorem 2 (K truncated negative binomial D_{eta,gamma}) and Theorem 6 (K Poisson with mean mu) bound the *Renyi* DP
  of the tuned algorithm, order by order, from the RDP (and, for Poisson, one (eps_hat, delta_hat)-DP point) of one
  trial; :func:`random_stopping_epsilon` converts that RDP curve to (epsilon, delta)-DP with ``dp_accounting``'s
  conversion (Canonne, Kamath & Steinke 2020, Prop. 12). One trial is a random choice among the points, so its RDP
  is at most the worst point's (Renyi divergence is quasi-convex) and its delta_hat at most the worst point's.
  "The points" are every point of the grid, drawn or not (which are drawn is itself random): the driver builds each
  one's mechanism from its config before anything trains (``candidates`` in the sweep file). The parent reports
  this bound as ``sweep_epsilon_best_rdp``, the privacy-profile bound of workbench/selection.py as
  ``sweep_epsilon_best_profile``, and the smaller of the two (both valid) as ``sweep_epsilon_best``.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import random
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from workbench import privacy
from workbench.errors import WorkbenchError
from workbench.tracking.runs import PARENT_TAG, SWEEP_FILE, SWEEP_TAG
from workbench.tracking.tracker import MlflowTracker
from workbench.tracking.uris import tracking_uri, ui_command

log = logging.getLogger("workbench")

TUNINGS = ("all", "random_stopping")
TRIALS = ("poisson", "truncated_negative_binomial")
TERMINAL = ("FINISHED", "FAILED", "KILLED")
PENDING_TAG = "workbench.sweep_pending"  # on the parent while points still run after the driver ended
DP_EVENT_TAG = "workbench.dp_event"  # on each child: its mechanism and planned steps (run.py)
# RDP orders for the random-stopping bound: dp_accounting's RdpAccountant defaults, denser where the optimum lies.
ORDERS = np.concatenate([1 + np.arange(1, 100) / 10, np.arange(11, 64), [128, 256, 512, 1024]]).astype(float)


# ------------------------------------------------------------------------------------------------ privacy cost


def composed_epsilon(runs: Sequence[tuple[privacy.Accountant, int]], delta: float) -> float:
    """Epsilon at `delta` of publishing every run: the PLD composition of their DP events (one discretization)."""
    pld = None
    for accountant, steps in runs:
        if steps == 0:
            continue
        if accountant.noise_multiplier == 0:
            return math.inf
        one = accountant.pld(steps)
        pld = one if pld is None else pld.compose(one)
    return 0.0 if pld is None else float(pld.get_epsilon_for_delta(delta))


def expected_trials(trials: str, poisson_mean: float = 3.0, eta: float = 0.0, gamma: float = 0.2) -> float:
    """E[K]: mu for Poisson; for the truncated negative binomial D_{eta,gamma} (Papernot & Steinke, Section 3.2)
    eta (1 - gamma) / (gamma (1 - gamma^eta)), and (1/gamma - 1) / log(1/gamma) at eta = 0 (logarithmic)."""
    if trials == "poisson":
        return poisson_mean
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 - gamma) / (gamma * (1 - gamma**eta))


def _tnb_pmf(k: int, eta: float, gamma: float) -> float:
    """P[K = k], k >= 1, of D_{eta,gamma}: (1-gamma)^k / (gamma^-eta - 1) prod_{l<k} (l+eta)/(l+1); at eta = 0
    the logarithmic distribution (1-gamma)^k / (k log(1/gamma))."""
    if eta == 0:
        return (1 - gamma) ** k / (k * math.log(1 / gamma))
    product = math.prod((l + eta) / (l + 1) for l in range(k))
    return (1 - gamma) ** k / (gamma**-eta - 1) * product


def draw_trials(s: DictConfig | Any, rng: random.Random) -> int:
    """K, the number of trials of a random-stopping sweep."""
    if s.trials == "poisson":
        return int(np.random.default_rng(rng.getrandbits(63)).poisson(s.poisson_mean))
    u, k, cdf = rng.random(), 0, 0.0
    while cdf < u and k < 100_000:
        k += 1
        cdf += _tnb_pmf(k, s.tnb_eta, s.tnb_gamma)
    return k


def _distinct_mechanisms(runs):
    """The runs that spend privacy, one per mechanism (a learning-rate sweep needs one computation), and the answer
    when there is nothing to compute: inf when one has no noise, 0 when none takes a step (data never read)."""
    runs = [(a, n) for a, n in runs if n > 0]
    if any(a.noise_multiplier == 0 for a, _ in runs):
        return runs, math.inf
    if not runs:
        return runs, 0.0
    return list({(a.sample_rate, a.noise_multiplier, a.world_size, a.shard, n): (a, n) for a, n in runs}.values()), None


def profile_epsilon(runs: Sequence[tuple[privacy.Accountant, int]], delta: float, trials: str,
                    poisson_mean: float = 3.0, eta: float = 0.0, gamma: float = 0.2) -> float:
    """Epsilon at `delta` of publishing only the best of K trials, each one of `runs`, from their privacy profiles
    (:func:`workbench.selection.profile_epsilon`). A trial is a uniformly drawn run: its profile is at most the
    worst run's, t by t (the hockey-stick divergence is jointly convex), and that maximum is what is used."""
    from workbench import selection

    runs, trivial = _distinct_mechanisms(runs)
    if trivial is not None:
        return trivial
    plds = [a.pld(n) for a, n in runs]
    phi_prime = selection.pgf_derivative(trials, poisson_mean, eta, gamma)
    return selection.profile_epsilon(lambda t: np.max([p.get_delta_for_epsilon(t) for p in plds], axis=0), delta,
                                     phi_prime)


def random_stopping_epsilon(runs: Sequence[tuple[privacy.Accountant, int]], delta: float, trials: str,
                            poisson_mean: float = 3.0, eta: float = 0.0, gamma: float = 0.2,
                            orders: Sequence[float] = ORDERS) -> float:
    """Epsilon at `delta` of publishing only the best of K trials, each trial one of `runs` (a random point).

    Per RDP order lambda, with eps(lambda) the worst trial's RDP:
      truncated negative binomial (Theorem 2), minimised over lambda_hat in {1} + orders:
        eps'(lambda) = eps(lambda) + (1+eta)(1 - 1/lambda_hat) eps(lambda_hat) + (1+eta) log(1/gamma)/lambda_hat
                       + log(E[K]) / (lambda - 1)
      Poisson (Theorem 6), with delta_hat the worst trial's delta at eps_hat = log(1 + 1/(lambda-1)) (from its PLD):
        eps'(lambda) = eps(lambda) + mu delta_hat + log(mu) / (lambda - 1)
    then the RDP-to-(epsilon, delta) conversion of dp_accounting.rdp.compute_epsilon, minimised over lambda.
    """
    orders = np.asarray(orders, dtype=float)
    runs, trivial = _distinct_mechanisms(runs)
    if trivial is not None:
        return trivial
    absl = logging.getLogger("absl")  # dp_accounting drops orders whose series does not converge, one line each
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        rdp = np.max([acc.rdp(steps, orders) for acc, steps in runs], axis=0)
    finally:
        absl.setLevel(level)
    if trials == "truncated_negative_binomial":
        hat = np.concatenate([[(1 + eta) * math.log(1 / gamma)],
                              (1 + eta) * (1 - 1 / orders) * rdp + (1 + eta) * math.log(1 / gamma) / orders])
        log_mean = math.log(expected_trials(trials, eta=eta, gamma=gamma))
        total = rdp + hat.min() + log_mean / (orders - 1)
    elif trials == "poisson":
        eps_hat = np.log1p(1 / (orders - 1))
        order = np.argsort(eps_hat)  # dp_accounting wants ascending epsilons
        delta_hat = np.empty_like(eps_hat)
        delta_hat[order] = np.max([acc.pld(steps).get_delta_for_epsilon(eps_hat[order]) for acc, steps in runs], axis=0)
        total = rdp + poisson_mean * delta_hat + math.log(poisson_mean) / (orders - 1)
    else:
        raise WorkbenchError(f"sweep.trials={trials!r} is unknown; choose one of {', '.join(TRIALS)}")
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    return float(compute_epsilon(list(orders), list(total), delta)[0])


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
    sweep_dir = Path(sweep_dir).resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"sweep": OmegaConf.to_container(s, resolve=True), "parent_run_id": None}
    if s.tuning == "random_stopping" and points:
        state["trials"] = draw(s, len(points))
        state["varies"] = _varied_keys(points)
        if compose_point is None:
            from workbench.api import compose as compose_point
        state["candidates"] = [{"overrides": " ".join(p), **_candidate(compose_point, p)} for p in points]
    if cfg.tracking.enabled:
        tracker = MlflowTracker(cfg)
        experiment_id = tracker._experiment_id()  # pylint: disable=protected-access
        name = f"sweep {sweep_dir.parent.name}/{sweep_dir.name}"
        run = tracker.client.create_run(experiment_id, run_name=name,
                                        tags={SWEEP_TAG: str(sweep_dir), "workbench.role": "sweep"})
        # A parent only groups its children: never left RUNNING, whatever happens to the driver.
        tracker.client.set_terminated(run.info.run_id, status="FINISHED")
        state.update(parent_run_id=run.info.run_id, tracking_uri=tracker.uri)
    _write(sweep_dir / SWEEP_FILE, state)
    return state


def draw(s: DictConfig | Any, points: int) -> list[int]:
    """How many times each of `points` points is trained under random stopping: K trials, each a uniform point."""
    rng = random.Random(s.seed) if s.seed is not None else random.SystemRandom()
    picks = [rng.randrange(points) for _ in range(draw_trials(s, rng))]
    return [picks.count(i) for i in range(points)]


def _candidate(compose_point: Callable[[Sequence[str]], DictConfig], point: Sequence[str]) -> dict:
    """A point's mechanism from its config, before anything trains (workbench.run.planned_mechanism); a point that
    cannot be built is recorded with the reason: the bound cannot cover it."""
    from workbench.run import planned_mechanism

    try:
        return planned_mechanism(compose_point(point))
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


def _job_config(config: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """The config Hydra's launcher gives the job with these overrides (its own loader: the driver's Hydra stays as
    it is), as workbench.compose returns it."""
    from hydra.core.global_hydra import GlobalHydra

    from workbench import config as config_

    cfg = GlobalHydra.instance().config_loader().load_sweep_config(config, list(overrides))
    config_.record_choices(cfg, cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _grid(config: DictConfig) -> list[list[str]]:
    """The jobs (their overrides, in job-number order) Hydra's basic sweeper makes of the command line."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def _varied_keys(points: Sequence[Sequence[str]]) -> list[str]:
    """The override keys whose value differs between points."""
    parsed = [dict(o.lstrip("+~").partition("=")[::2] for o in point) for point in points]
    return sorted(k for k in set().union(*parsed) if len({p.get(k) for p in parsed}) > 1)


def _changes_the_mechanism(key: str) -> bool:
    """Whether an override can change a run's DP event (noise, rate, steps, world size, data)."""
    from workbench.config import PRIVACY_FIELDS

    if key in ("seed", "data_seed", "privacy.secure_seed"):  # other streams, the same mechanism
        return False
    return key in ("experiment", "shard", "launcher") or key.startswith("launcher.") or any(
        key == f or f.startswith(key + ".") or key.startswith(f + ".") for f in PRIVACY_FIELDS)


# ------------------------------------------------------------------------------------------------------ summary


def _cost(runs, state: dict) -> tuple[dict[str, float], list[str]]:
    """sweep_epsilon_all (and _best) from the children's recorded DP events, and the warnings that go with them."""
    s = state["sweep"]
    notes, events, data = [], [], set()
    for _, row in runs.iterrows():
        event = row.get(f"tags.{DP_EVENT_TAG}")
        if not isinstance(event, str):  # non-private, or failed before it trained (costs nothing)
            if str(row.get("params.privacy.enabled")) == "False":
                notes.append(f"point {row.get('tags.overrides', row['run_id'])!r} is not private: publishing it is "
                             "not differentially private at all; the sweep's epsilons leave it out")
            continue
        e = json.loads(event)
        # A point that ended early spent at most its planned steps: count those (an upper bound).
        steps = int(row["steps"]) if row["status"] == "FINISHED" and row.get("steps") == row.get("steps") else e["planned_steps"]
        events.append((privacy.Accountant("pld", e["sample_rate"], e["noise_multiplier"], e["world_size"], e["shard"]),
                       steps, e["delta"]))
        data.add(tuple(sorted((k, str(v)) for k, v in row.items() if k.startswith("params.data.train"))))
    if not events and not (state.get("candidates") and s["tuning"] == "random_stopping"):
        return {}, notes
    if len(data) > 1:
        notes.append("the points trained on different data (data.train differs): these bounds are for one dataset "
                     "and one add-or-remove-one neighbour relation shared by every point; across different datasets "
                     "one person's example is not one neighbouring change of every point, so account each dataset's "
                     "points separately")
    mechanisms, unbounded, deltas = [], [], [d for _, _, d in events]
    if s["tuning"] == "random_stopping":
        mechanisms, unbounded, planned = _candidates(state, events, notes)
        deltas += planned
    cost: dict[str, float] = {}
    if deltas:
        cost["sweep_delta"] = delta = min(deltas)
        if events:
            cost["sweep_epsilon_all"] = composed_epsilon([(a, n) for a, n, _ in events], delta)
    if s["tuning"] == "random_stopping":
        cost.update(_best(mechanisms, unbounded, cost.get("sweep_delta"), s, notes))
    return cost, notes


def _candidates(state: dict, events: list, notes: list[str]):
    """Every point a random-stopping sweep could have drawn, as (accountant, steps), and the points no bound covers
    (not private, or not buildable): the theorems need the worst of all of them, drawn or not. A trained child whose
    recorded mechanism no candidate covers (its world size differed from the planned one...) is added too. Returns
    (mechanisms, unbounded points, the candidates' deltas)."""
    candidates = state.get("candidates")
    if candidates is None:  # a sweep started without its points: only the trained ones are known
        untried = [i for i, n in enumerate(state.get("trials") or []) if n == 0]
        varied = [k for k in state.get("varies", []) if _changes_the_mechanism(k)]
        unbounded = [f"{len(untried)} point(s) never drawn whose mechanism is unknown (the points differ in "
                     f"{', '.join(varied)})"] if untried and varied else []
        return [(a, n) for a, n, _ in events], unbounded, []
    mechanisms, unbounded, deltas = [], [], []
    for c in candidates:
        if "sample_rate" in c:
            accountant = privacy.Accountant("pld", c["sample_rate"], c["noise_multiplier"], c["world_size"], c["shard"])
            mechanisms.append((accountant, int(c["planned_steps"])))
            deltas.append(c["delta"])
        else:
            unbounded.append(f"{c['overrides']!r} ({'not private' if c.get('private') is False else c.get('error')})")
    for a, n, _ in events:  # covered: the same mechanism planned for at least as many steps
        if not any(_key(a) == _key(b) and n <= m for b, m in mechanisms):
            notes.append(f"a trained point spent q={a.sample_rate:.4g} sigma={a.noise_multiplier:.4g} W={a.world_size} "
                         f"for {n} steps, which no candidate planned: the bound includes it")
            mechanisms.append((a, n))
    return mechanisms, unbounded, deltas


def _key(a: privacy.Accountant) -> tuple:
    return (round(a.sample_rate, 12), round(a.noise_multiplier, 12), a.world_size, a.shard)


def _best(mechanisms, unbounded: list[str], delta: float | None, s: dict, notes: list[str]) -> dict[str, float]:
    """sweep_epsilon_best and its two bounds: Papernot & Steinke's RDP one and the privacy-profile one
    (workbench/selection.py). Both are valid upper bounds, so the smaller is published."""
    if unbounded or delta is None:
        notes.append(f"random stopping: no finite bound for publishing the best: {'; '.join(unbounded)} could be "
                     "drawn, and the bound needs every point to be differentially private")
        return {"sweep_epsilon_best": math.inf, "sweep_epsilon_best_rdp": math.inf, "sweep_epsilon_best_profile": math.inf}
    args = (delta, s["trials"], s["poisson_mean"], s["tnb_eta"], s["tnb_gamma"])
    cost = {"sweep_epsilon_best_profile": profile_epsilon(mechanisms, *args)}
    try:
        cost["sweep_epsilon_best_rdp"] = random_stopping_epsilon(mechanisms, *args)
    except WorkbenchError as e:  # no RDP accountant for parallel Poisson: the profile bound alone
        notes.append(f"no RDP bound for random stopping: {e}")
    cost["sweep_epsilon_best"] = min(cost.values())
    return cost


def _distinct(runs, row) -> str:
    """A point's overrides without those every point shares: what picks it out of the sweep."""
    if "tags.overrides" not in runs or not isinstance(row.get("tags.overrides"), str):
        return row["run_id"]
    shared = set.intersection(*(set(str(o).split()) for o in runs["tags.overrides"]))
    return " ".join(o for o in row["tags.overrides"].split() if o not in shared) or row["tags.overrides"]


def summarise(tracker: MlflowTracker, state: dict) -> dict:
    """Log the sweep's table, frontier, best points, counts and privacy cost on its parent run; print one line."""
    from workbench.run_tables import sweep_frame
    from workbench.plots import frontier

    s = state["sweep"]
    runs = sweep_frame(state["parent_run_id"], tracker.uri)
    counts = runs["status"].value_counts().to_dict() if len(runs) else {}
    summary: dict[str, Any] = {"points": len(runs), "points_finished": counts.get("FINISHED", 0),
                               "points_failed": counts.get("FAILED", 0) + counts.get("KILLED", 0)}
    metrics = [c for c in runs.columns if c not in ("run_id", "run_name", "status", "start_time", "end_time",
                                                    "experiment_id", "parent_run_id", "role")
               and not c.startswith(("params.", "tags."))]
    first = [c for c in ("epsilon", "delta", *s["metrics"]) if c in metrics]
    table = runs.assign(overrides=runs.get("tags.overrides", ""))[
        ["overrides", "status", *first, *sorted(set(metrics) - set(first)), "run_id"]]
    finished = runs[runs["status"] == "FINISHED"]
    tags, best_parts = {}, []
    for metric, mode in s["metrics"].items():
        if metric not in finished or finished[metric].notna().sum() == 0:
            continue
        row = finished.loc[finished[metric].idxmax() if mode == "max" else finished[metric].idxmin()]
        summary[f"best_{metric}"] = float(row[metric])
        tags[f"best_{metric}_run_id"] = row["run_id"]
        tags[f"best_{metric}_overrides"] = row.get("tags.overrides", "")
        best_parts.append(f"best {metric}={row[metric]:.4f} ({_distinct(runs, row)})")
    cost, notes = _cost(runs[runs["status"].isin(TERMINAL)], state)
    summary.update(cost)
    for note in notes:
        warnings.warn(f"sweep: {note}", stacklevel=1)
    tracker.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))}, 0)
    if notes:
        tags["sweep_notes"] = " | ".join(notes)[:5000]
    tracker.set_tags(tags)
    if PENDING_TAG in tracker.client.get_run(tracker.run_id).data.tags:
        tracker.client.delete_tag(tracker.run_id, PENDING_TAG)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sweep_table.csv"
        table.to_csv(path, index=False)
        tracker.log_artifact(path)
        metric = next(iter(s["metrics"]), None)
        if metric in finished and "epsilon" in finished and finished[metric].notna().any():
            tracker.log_figure(frontier(finished, metric), "frontier.png")
    parts = [f"sweep done: {summary['points']} points ({summary['points_finished']} FINISHED, "
             f"{summary['points_failed']} FAILED)", *best_parts]
    if "sweep_delta" in cost:
        parts.append(", ".join(f"{k}={cost[k]:.3f}" for k in ("sweep_epsilon_all", "sweep_epsilon_best") if k in cost)
                     + "".join(f" (profile {cost['sweep_epsilon_best_profile']:.3f}, rdp "
                               f"{cost.get('sweep_epsilon_best_rdp', math.nan):.3f})" for _ in [0]
                               if "sweep_epsilon_best_profile" in cost)
                     + f" at delta={cost['sweep_delta']:.1e}")
    parts.append(f"parent run_id={tracker.run_id} | {ui_command(tracker.uri or tracking_uri(None))}")
    print(" | ".join(parts), flush=True)
    return {**summary, "table": table, "notes": notes, **{f"tag:{k}": v for k, v in tags.items()}}
