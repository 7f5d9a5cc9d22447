"""The ledger of one run (:class:`Accountant`: epsilon as a function of steps) and its epsilon at every logging step,
computed ahead on a background thread (:class:`EpsilonSchedule`).

Accountants (``ACCOUNTANTS``): ``pld`` (default, tightest; ``dp_accounting`` privacy loss distributions with
pessimistic rounding, an upper bound), ``rdp`` (``dp_accounting`` Renyi DP), ``prv`` (Opacus' PRV accountant).
Only ``pld`` supports ``shard="global"`` with ``W > 1``.

Neighbouring relation. The events are dp_accounting's under its default ``ADD_OR_REMOVE_ONE``; its PLD and RDP of a
Poisson-subsampled Gaussian, the parallel-Poisson mixture and the plain Gaussian are the same under
``REPLACE_SPECIAL`` (zero-out: one record replaced by one that contributes nothing), so one epsilon serves both. Which
one a run's epsilon holds for is its sampler's business, said by ``Mechanism.adjacency`` (workbench/privacy/
mechanism.py): add-or-remove for dpsgd's Poisson over the whole set (shard=global, or one process), zero-out where an
example's role is fixed by its index (per_rank on W > 1 ranks, bandmf, blt); tests/test_adjacency.py checks both.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from workbench.errors import WorkbenchError
from workbench.privacy.accounting.events import _check_event_args, _is_int, _is_real, _step_event, dp_event
from workbench.privacy.accounting.lazy import _pld, _rdp, dp_accounting
from workbench.privacy.accounting.pld import DEFAULT_PLD_DISCRETIZATION, StepPLD, _step_pld
from workbench.privacy.accounting.solve import meeting_end

def code_version() -> str:
    """What a cached privacy result (workbench/cache.py) depends on besides its arguments: this package's source and
    the accounting libraries' versions."""
    from workbench import cache

    return cache.code_version(tuple(f"privacy/accounting/{name}.py" for name in MODULES) + ("privacy/blt.py",),
                              ("dp-accounting", "opacus"))


# what an epsilon is computed by (a cached result is stale when one of them changes)
MODULES = ("lazy", "events", "pld", "pld_losses", "accountant", "calibration", "solve", "banded", "blt")
ACCOUNTANTS = ("pld", "rdp", "prv")

_STATE_KEYS = ("kind", "sample_rate", "noise_multiplier", "world_size", "shard", "pld_discretization", "steps")


class Accountant:
    """Privacy ledger of one run: fixed (sample_rate, noise_multiplier, world_size, shard), epsilon a function of steps.

    Args:
        kind: ``pld`` | ``rdp`` | ``prv``.
        sample_rate: per-rank Poisson rate (``q`` for ``per_rank``, ``q_r`` for ``global``).
        noise_multiplier: sigma (noise std / clipping norm), added once cluster-wide. 0 means no privacy (eps=inf).
        world_size, shard: see :func:`dp_event`. ``shard="global"`` with ``world_size > 1`` needs ``kind="pld"``.
        pld_discretization: PLD value discretization interval (``pld`` only; see ``DEFAULT_PLD_DISCRETIZATION``).

    ``epsilon(steps, delta)`` is cached per (steps, delta); the PLD of one step is built once and self-composed.
    ``steps`` counts the logical steps taken (``step()`` after each); it is saved by ``state_dict``.
    """

    def __init__(self, kind: str, sample_rate: float, noise_multiplier: float, world_size: int = 1,
                 shard: str = "per_rank", pld_discretization: float = DEFAULT_PLD_DISCRETIZATION):
        if kind not in ACCOUNTANTS:
            raise WorkbenchError(f"accountant {kind!r} is unknown; choose one of {', '.join(ACCOUNTANTS)}")
        _check_event_args(sample_rate, noise_multiplier, world_size, shard)
        if not (_is_real(pld_discretization) and 0 < pld_discretization <= 0.1):
            raise WorkbenchError(f"pld_discretization must be in (0, 0.1], got {pld_discretization!r}")
        if shard == "global" and world_size > 1 and kind != "pld":
            raise WorkbenchError(f"accountant {kind!r} does not support shard=global (parallel Poisson) with "
                                 f"world_size={world_size}; use privacy.accountant=pld")
        self.kind = kind
        self.sample_rate = float(sample_rate)
        self.noise_multiplier = float(noise_multiplier)
        self.world_size = int(world_size)
        self.shard = shard
        self.pld_discretization = float(pld_discretization)
        self.steps = 0
        self._cache: dict[tuple[int, float], float] = {}
        self._pld_step: StepPLD | None = None

    def __repr__(self) -> str:
        return (f"Accountant(kind={self.kind!r}, sample_rate={self.sample_rate}, noise_multiplier="
                f"{self.noise_multiplier}, world_size={self.world_size}, shard={self.shard!r}, steps={self.steps})")

    def step(self, n: int = 1) -> None:
        """Record ``n`` logical steps taken."""
        self.steps += int(n)

    def event(self, steps: int) -> dp_accounting.DpEvent:
        return dp_event(self.sample_rate, self.noise_multiplier, steps, self.world_size, self.shard)

    def epsilon(self, steps: int, delta: float, on_disk: bool = False) -> float:
        """Epsilon after ``steps`` logical steps at ``delta`` (an upper bound; ``inf`` when sigma is 0).
        ``on_disk``: also kept in workbench's on-disk cache, so that a rerun of the same job reads it back."""
        if not (_is_int(steps) and steps >= 0):
            raise WorkbenchError(f"steps must be an integer >= 0, got {steps!r}")
        if not (_is_real(delta) and 0 < delta < 1):
            raise WorkbenchError(f"delta must be in (0, 1), got {delta!r}")
        key = (int(steps), float(delta))
        if on_disk and steps > 0 and self.noise_multiplier > 0:  # written even when known here (the budget search)
            from workbench import cache

            mechanism = {k: v for k, v in self.state_dict().items() if k != "steps"}
            self._cache[key] = cache.cached(
                "epsilon", lambda: self._cache[key] if key in self._cache else self._compute_epsilon(*key),
                **mechanism, steps=key[0], delta=key[1], code=code_version())
        elif key not in self._cache:
            self._cache[key] = self._compute_epsilon(*key)
        return self._cache[key]

    def _compute_epsilon(self, steps: int, delta: float) -> float:
        if steps == 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        if self.kind == "pld":
            return float(self.pld(steps).get_epsilon_for_delta(delta))
        if self.kind == "rdp":
            return float(_rdp.RdpAccountant().compose(self.event(steps)).get_epsilon(delta))
        from opacus.accountants import PRVAccountant

        prv = PRVAccountant()
        prv.history = [(self.noise_multiplier, self.sample_rate, steps)]
        return float(prv.get_epsilon(delta))

    def pld(self, steps: int) -> _pld.PrivacyLossDistribution:
        """The privacy loss distribution of ``steps`` steps (whatever ``kind``): what a sweep composes across runs."""
        d = self.pld_discretization
        if self._pld_step is None:
            self._pld_step = StepPLD(_step_pld(_step_event(self.sample_rate, self.noise_multiplier, self.world_size,
                                                           self.shard), d))
        # identity().compose(...) reproduces PLDAccountant(d).compose(event).get_epsilon(delta) bit for bit
        return _pld.identity(value_discretization_interval=d).compose(self._pld_step.self_compose(int(steps)))

    def rdp(self, steps: int, orders) -> np.ndarray:
        """Renyi DP of ``steps`` steps at each of ``orders`` (``dp_accounting``'s RDP accountant)."""
        if self.shard == "global" and self.world_size > 1:
            raise WorkbenchError(f"no RDP accountant for shard=global (parallel Poisson) with world_size={self.world_size}")
        accountant = _rdp.RdpAccountant(orders=list(orders)).compose(self.event(int(steps)))
        return np.asarray(accountant._rdp, dtype=float)  # pylint: disable=protected-access

    def max_steps(self, target_epsilon: float, delta: float, upper: int) -> int:
        """The largest ``T <= upper`` with ``epsilon(T, delta) <= target_epsilon``; 0 if one step already exceeds it.

        A bracketing search (``epsilon(lo) <= target < epsilon(hi)`` throughout, so the answer is exact whatever the
        shape of the curve) that guesses by regula falsi on log(epsilon) against log(T) (solve.py).
        """
        if not (_is_int(upper) and upper >= 0):
            raise WorkbenchError(f"upper must be an integer >= 0, got {upper!r}")
        if not (_is_real(target_epsilon) and target_epsilon > 0):
            raise WorkbenchError(f"target_epsilon must be > 0, got {target_epsilon!r}")
        upper = int(upper)
        if upper == 0 or self.epsilon(1, delta) > target_epsilon:
            return 0
        if self.epsilon(upper, delta) <= target_epsilon:
            return upper
        return meeting_end(lambda t: self.epsilon(t, delta), target_epsilon, 1, upper)  # 1 meets, upper exceeds

    def coarser(self, factor: float) -> "Accountant":
        """The same mechanism on a PLD grid ``factor`` times coarser: a looser upper bound, composed faster."""
        return type(self).from_state_dict({**self.state_dict(), "steps": 0,
                                           "pld_discretization": min(self.pld_discretization * factor, 0.1)})

    def state_dict(self) -> dict[str, Any]:
        """Plain Python types only (safe for ``torch.load(weights_only=True)``)."""
        return {"kind": self.kind, "sample_rate": self.sample_rate, "noise_multiplier": self.noise_multiplier,
                "world_size": self.world_size, "shard": self.shard, "pld_discretization": self.pld_discretization,
                "steps": int(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``steps``; the saved mechanism must be this accountant's (a resumed run cannot change it)."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise WorkbenchError(f"accountant state is missing {', '.join(missing)}")
        mine = self.state_dict()
        for key in _STATE_KEYS[:-1]:
            a, b = mine[key], state[key]
            same = (_is_real(b) and math.isclose(a, b, rel_tol=1e-9)) if isinstance(a, float) else a == b
            if not same:
                raise WorkbenchError(f"accountant state has {key}={b!r} but this run has {key}={a!r}; "
                                     "a resumed run must keep its privacy mechanism")
        if not (_is_int(state["steps"]) and state["steps"] >= 0):
            raise WorkbenchError(f"accountant state has steps={state['steps']!r}; expected an integer >= 0")
        self.steps = int(state["steps"])

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "Accountant":
        """A new accountant with the saved mechanism and steps."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise WorkbenchError(f"accountant state is missing {', '.join(missing)}")
        acc = cls(state["kind"], state["sample_rate"], state["noise_multiplier"], state["world_size"], state["shard"],
                  state["pld_discretization"])
        acc.load_state_dict(state)
        return acc


EXACT_LINES = 64  # at most this many PLD compositions per run's schedule
COARSER = (16, 8, 4, 2)  # PLD grids, in multiples of the run's, tried for the lines before the last
LINE_SLACK = 0.005  # the coarse grid's epsilon at the last step may exceed the run's grid's by this much (relative)


def exact_steps(steps: list[int], n: int = EXACT_LINES) -> list[int]:
    """The logged steps whose epsilon is composed: all of them when there are at most ``n``, else about ``n`` spaced
    geometrically in the line index (dense early, where epsilon grows fastest relative to itself), always with the
    last."""
    if len(steps) <= n:
        return list(steps)
    picked = {round(len(steps) ** (k / (n - 1))) - 1 for k in range(n)} | {len(steps) - 1}
    return [steps[i] for i in sorted(picked)]


class EpsilonSchedule:
    """Epsilon at each of a run's logging steps, computed once on a background thread.

    q, sigma and the step count are fixed before the first step, so the whole curve is known in advance, and the
    training thread never waits for a PLD composition. Every value is an upper bound, never an under-report:

    - the last line: the accountant's own ``epsilon(last, delta)``, equal to the reported final epsilon; computed first;
    - the lines before it: composed at ``exact_steps`` (every line when there are at most ``EXACT_LINES``), each line
      taking the value of the next composed step, on a coarser PLD grid (pessimistic rounding: still an upper bound)
      when one is within ``LINE_SLACK`` of the run's grid at the last step: the coarsest of ``COARSER`` that is,
      checked there, where the grid's looseness is largest. So a line is at most ``LINE_SLACK`` above a fresh
      computation of its composed step (and equal to it where no coarser grid qualifies). A composition's cost falls
      about as fast as the grid coarsens, and ``StepPLD`` shares the step's truncation bounds between compositions,
      so dense logging costs well under 5 % of a run, short or 100,000 steps long (benchmarks/LOGGING_COST.md).
      No line exceeds the last (epsilon grows with the steps: the last value bounds every earlier step too).
    """

    def __init__(self, accountant: "Accountant", delta: float, steps):
        import bisect
        import threading

        self.accountant, self.delta, self.steps = accountant, delta, sorted(set(steps))
        self.exact = exact_steps(self.steps)
        self._cover = {s: self.exact[bisect.bisect_left(self.exact, s)] for s in self.steps}  # the next exact step
        self._values: dict[int, float] = {}
        self._error: BaseException | None = None
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="workbench-epsilon-schedule", daemon=True)
        self._thread.start()

    def lines_accountant(self, last_value: float) -> "Accountant":
        """The accountant of the lines before the last: the same mechanism on the coarsest grid of ``COARSER`` within
        ``LINE_SLACK`` of ``last_value`` at the last step; the run's own when none is, or when it has no PLD grid."""
        if getattr(self.accountant, "kind", None) != "pld" or len(self.steps) == 1:
            return self.accountant
        for factor in COARSER:
            coarse = self.accountant.coarser(factor)
            if coarse.epsilon(self.exact[-1], self.delta, on_disk=True) <= last_value * (1 + LINE_SLACK):
                return coarse
        return self.accountant

    def _work(self) -> None:
        try:
            # scipy's import under the first composition: a rerun of the same job reads its schedule, the final
            # epsilon included, from workbench's on-disk cache.
            last = self.accountant.epsilon(self.exact[-1], self.delta, on_disk=True)
            with self._done:
                self._values[self.exact[-1]] = last
                self._done.notify_all()
            lines = self.lines_accountant(last)
            for step in self.exact[:-1]:
                value = min(lines.epsilon(step, self.delta, on_disk=True), last)
                with self._done:
                    self._values[step] = value
                    self._done.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised where a value is asked for
            with self._done:
                self._error = e
                self._done.notify_all()

    def get(self, step: int, wait: bool = True) -> float | None:
        """Epsilon reported after ``step`` steps (see the class); with ``wait=False``, None while being computed."""
        if step not in self._cover:
            return self.accountant.epsilon(step, self.delta) if wait else None
        exact = self._cover[step]
        with self._done:
            if wait:
                self._done.wait_for(lambda: exact in self._values or self._error is not None)
            if self._error is not None:
                raise RuntimeError("the epsilon schedule failed") from self._error
            return self._values.get(exact)

    def latest(self, step: int) -> tuple[int, float] | None:
        """The newest (logged step, epsilon) already known at or before ``step``, without waiting."""
        import bisect

        with self._done:
            for i in range(bisect.bisect_right(self.steps, step) - 1, -1, -1):
                if self._cover[self.steps[i]] in self._values:
                    return self.steps[i], self._values[self._cover[self.steps[i]]]
            return None

