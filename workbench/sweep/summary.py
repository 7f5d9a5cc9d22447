"""A sweep's summary on its parent run, once the last point has ended: the table, the frontier, the best point per
metric, the counts, and what the sweep costs in privacy (from each child's recorded DP event; the math is
workbench/privacy/accounting/tuning.py)."""
from __future__ import annotations

import json
import logging
import math
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

from workbench import privacy
from workbench.errors import WorkbenchError
from workbench.privacy.mechanism import accountant_of
from workbench.privacy.accounting.tuning import composed_epsilon, profile_epsilon, random_stopping_epsilon
from workbench.tracking.runs import NOTE_TAG
from workbench.tracking.tracker import MlflowTracker
from workbench.tracking.uris import tracking_uri, ui_command

log = logging.getLogger("workbench")

TERMINAL = ("FINISHED", "FAILED", "KILLED")
PENDING_TAG = "workbench.sweep_pending"  # on the parent while points still run after the driver ended
DP_EVENT_TAG = "workbench.dp_event"  # on each child: its mechanism and planned steps (run.py)


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


def _cost(runs, state: dict) -> tuple[dict[str, float], list[str], str | None]:
    """sweep_epsilon_all (and _best) from the children's recorded DP events, the warnings that go with them, and the
    neighbouring relation they hold for (the points' and candidates' own, workbench/privacy/mechanism.py)."""
    s = state["sweep"]
    notes, events, data, units, relations = [], [], set(), set(), set()
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
        events.append((accountant_of(e), steps, e["delta"]))  # its mechanism's (privacy/mechanism.py's registry)
        data.add(tuple(sorted((k, str(v)) for k, v in row.items() if k.startswith("params.data.train"))))
        units.add(e.get("unit", "example"))  # privacy.unit=user: workbench/privacy/users.py
        relations.add(e.get("adjacency"))
    if not events and not (state.get("candidates") and s["tuning"] == "random_stopping"):
        return {}, notes, None
    if s["tuning"] == "random_stopping":
        relations |= {c.get("adjacency") for c in state.get("candidates") or [] if "sample_rate" in c}
    if len(data) > 1:
        notes.append("the points trained on different data (data.train differs): these bounds are for one dataset "
                     "and one neighbour relation shared by every point; across different datasets "
                     "one person's example is not one neighbouring change of every point, so account each dataset's "
                     "points separately")
    if len(units) > 1:
        notes.append("the points protect different units (privacy.unit: example and user): their epsilons are not of "
                     "one neighbour relation, so these composed bounds hold for neither; account each unit's points "
                     "separately")
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
    return cost, notes, _shared_relation(relations)


def _shared_relation(relations: set) -> str | None:
    """The relation every point's epsilon holds for: theirs when they agree; zero-out when some are add-or-remove
    (those hold zero-out too, at the same epsilon: Mechanism.adjacency); None when unknown or of different units."""
    if None in relations or not relations or len({r.rsplit(" ", 1)[-1] for r in relations}) > 1:
        return None
    return relations.pop() if len(relations) == 1 else f"zero-out one {next(iter(relations)).rsplit(' ', 1)[-1]}"


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
            accountant = accountant_of(c)
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
    return (round(a.sample_rate, 12), round(a.noise_multiplier, 12), a.world_size, a.shard, getattr(a, "num_bands", 0),
            getattr(a, "blt", None), getattr(a, "min_sep", 0), getattr(a, "planned_steps", 0))  # blt's event


def _best(mechanisms, unbounded: list[str], delta: float | None, s: dict, notes: list[str]) -> dict[str, float]:
    """sweep_epsilon_best and its two bounds: Papernot & Steinke's RDP one and the privacy-profile one
    (workbench/privacy/accounting/selection.py). Both are valid upper bounds, so the smaller is published."""
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


def _covers(s: dict, cost: dict, best: list[str]) -> dict[str, str]:
    """Which epsilon covers which of what the sweep publishes (the parent's sweep_epsilon_*_covers tags). The best-of-K
    bound holds for the best trial's result alone, K unknown: K (the counts, the trials' tags and times), the table,
    the frontier and the other trials are a release of every trial, covered by the composition alone."""
    if "sweep_epsilon_all" not in cost and "sweep_epsilon_best" not in cost:
        return {}
    if s["tuning"] != "random_stopping":
        return {"sweep_epsilon_all_covers": "everything the parent and the sweep's runs show: every point's run, "
                                            "points, points_finished, points_failed, the best_* fields, "
                                            "sweep_table.csv, frontier.png"}
    return {"sweep_epsilon_best_covers": f"only the best trial's result: {', '.join(best) or 'the best point'} and "
                                         "that run's model and metrics; K stays hidden, so nothing else here",
            "sweep_epsilon_all_covers": "everything else the parent and the sweep's runs show: K (points, "
                                        "points_finished, points_failed, the runs' trial tags and times), "
                                        "sweep_table.csv, frontier.png, every other trial's run, the draw in the sweep "
                                        "folder, the summary's console line"}


def _covers_line(s: dict, cost: dict) -> str:
    if s["tuning"] != "random_stopping":
        return f"Everything this sweep shows is covered by sweep_epsilon_all={cost['sweep_epsilon_all']:.3f}."
    best = ", ".join(f"best_{m}" for m in s["metrics"])
    return (f"Publish only the best trial ({best}, its run's model and metrics) under sweep_epsilon_best="
            f"{cost['sweep_epsilon_best']:.3f}; K, the counts, the table, the frontier and the other trials are covered "
            f"by sweep_epsilon_all={cost.get('sweep_epsilon_all', math.inf):.3f} only.")


def _distinct(runs, row) -> str:
    """A point's overrides without those every point shares: what picks it out of the sweep."""
    if "tags.overrides" not in runs or not isinstance(row.get("tags.overrides"), str):
        return row["run_id"]
    shared = set.intersection(*(set(str(o).split()) for o in runs["tags.overrides"]))
    return " ".join(o for o in row["tags.overrides"].split() if o not in shared) or row["tags.overrides"]


def end_parent(client, parent_run_id: str, children, failed: bool = False) -> str:
    """End the parent when its last point has: at that point's end time (the sweep's span, not the driver's), FAILED
    if a point failed (or the summary did: `failed`), KILLED if one was killed, else FINISHED. Returns the status."""
    statuses = {c.info.status for c in children}
    status = "FAILED" if failed or "FAILED" in statuses else "KILLED" if "KILLED" in statuses else "FINISHED"
    ends = [c.info.end_time for c in children if c.info.end_time]
    end = max(ends) if ends else None
    client.set_tag(parent_run_id, "status", status.lower())
    client.set_terminated(parent_run_id, status=status, end_time=end)
    return status


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
    cost, notes, relation = _cost(runs[runs["status"].isin(TERMINAL)], state)
    summary.update(cost)
    if relation:
        tags["privacy_adjacency"] = relation
    tags.update(_covers(s, cost, [k for m in s["metrics"] if f"best_{m}" in summary
                                  for k in (f"best_{m}", f"best_{m}_run_id", f"best_{m}_overrides")]))
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
    experiment_id = tracker.client.get_run(tracker.run_id).info.experiment_id
    children = tracker.client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{tracker.run_id}'",
                                          max_results=50_000)
    summary["parent_status"] = end_parent(tracker.client, tracker.run_id, children)
    parts = [f"sweep done: {summary['points']} points ({summary['points_finished']} FINISHED, "
             f"{summary['points_failed']} FAILED)", *best_parts]
    if "sweep_delta" in cost:
        parts.append(", ".join(f"{k}={cost[k]:.3f}" for k in ("sweep_epsilon_all", "sweep_epsilon_best") if k in cost)
                     + "".join(f" (profile {cost['sweep_epsilon_best_profile']:.3f}, rdp "
                               f"{cost.get('sweep_epsilon_best_rdp', math.nan):.3f})" for _ in [0]
                               if "sweep_epsilon_best_profile" in cost)
                     + f" at delta={cost['sweep_delta']:.1e}")
    if "sweep_epsilon_all" in cost or "sweep_epsilon_best" in cost:  # the description says what each epsilon covers
        tracker.set_tags({NOTE_TAG: " | ".join(parts) + ". " + _covers_line(s, cost)})
    link = ui_command(tracker.uri or tracking_uri(None), experiment_id, tracker.run_id)
    parts.append(f"parent run_id={tracker.run_id} | {link}")
    print(" | ".join(parts), flush=True)
    return {**summary, "table": table, "notes": notes, **{f"tag:{k}": v for k, v in tags.items()}}
