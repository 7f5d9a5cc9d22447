"""Multirun sweeps: one parent run, made by the driver before any point starts; a summary on it once the last point has
ended (table, frontier, best point per metric, counts); and what the sweep costs in privacy.

The driver is whatever runs the points: Hydra calls :class:`SweepCallback` (``hydra.callbacks`` in conf/config.yaml)
in its own process for every launcher (basic, submitit plugin; points that use ``launcher=local|slurm`` submit from
there too); :func:`workbench.explore.sweep` calls :func:`start` and :func:`finish` itself. The driver writes the parent
run id to ``<sweep dir>/.workbench-sweep.json``; points read it (:func:`workbench.tracking.runs.sweep_parent`) and never
make a parent. When the driver ends before its points (``launcher.wait=false``) the last point to end summarises.

What a sweep costs is computed by workbench/privacy/accounting/tuning.py (its docstring says how): the parent reports
``sweep_epsilon_all`` and, with ``sweep.tuning=random_stopping``, ``sweep_epsilon_best`` (and its two bounds).

- driver.py   the parent run, each point's draw and config, the point that ends last, Hydra's :class:`SweepCallback`
- summary.py  the parent's table, frontier, best points, counts and privacy cost
"""

from workbench.sweep.driver import (TUNINGS, SweepCallback, check, draw, draw_trials, finish, job_ended, point_configs,
                                    point_ended, read_state, start, trials_for_point)
from workbench.privacy.accounting.tuning import (composed_epsilon, expected_trials, profile_epsilon,  # noqa: F401
                                                 random_stopping_epsilon)  # their old import path (notebooks)
from workbench.sweep.summary import DP_EVENT_TAG, PENDING_TAG, TERMINAL, summarise

__all__ = ["DP_EVENT_TAG", "PENDING_TAG", "TERMINAL", "TUNINGS", "SweepCallback", "check", "draw", "draw_trials",
           "finish", "job_ended", "point_configs", "point_ended", "read_state", "start", "summarise",
           "trials_for_point"]
