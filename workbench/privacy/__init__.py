"""Privacy accounting: the DP event of a run, its accountant, noise calibration and argument checks.

One concept per name (Opacus style):

- :func:`dp_event` -- the ``dp_accounting`` event of ``steps`` logical steps of DP-SGD.
  ``shard="per_rank"``: every step is a Poisson-subsampled Gaussian, ``PoissonSampled(q, Gaussian(sigma))``.
  ``shard="global"`` ("parallel Poisson"): each of the W ranks Poisson-samples every example at rate ``q_r``,
  so an example's multiplicity in a step is ``K ~ Binomial(W, q_r)`` and the step is the mixture of Gaussians
  ``sum_k Binom(k; W, q_r) N(k, sigma^2)`` vs ``N(0, sigma^2)`` (``MixtureOfGaussiansDpEvent``).
  For ``W == 1`` that mixture *is* the Poisson-subsampled Gaussian, and the Poisson event is returned.
- :class:`Accountant` -- the ledger of one run: fixed (kind, q, sigma, W, shard), epsilon as a function of steps.
- :class:`EpsilonSchedule` -- epsilon at every logging step of a run, computed ahead on a background thread.
- :func:`calibrate_noise` -- the smallest sigma that the same accountant class accepts for a target epsilon.
- :func:`validate_privacy_args`, :func:`default_delta` -- argument checks and the default delta (below 1/N).

Accountants (``ACCOUNTANTS``): ``pld`` (default, tightest; ``dp_accounting`` privacy loss distributions with
pessimistic rounding, an upper bound), ``rdp`` (``dp_accounting`` Renyi DP), ``prv`` (Opacus' PRV accountant).
Only ``pld`` supports ``shard="global"`` with ``W > 1``. The neighbouring relation is add-or-remove-one.

This package is where the DP mechanism is gathering (docs/DESIGN.md, "Parts"): per-sample clipping is
workbench/privacy/clipping/; the accounting above stays in this ``__init__`` until it moves to its own module.
"""

from __future__ import annotations

import importlib
import math
import numbers
from typing import Any

import numpy as np

from workbench.errors import WorkbenchError


class _Lazy:
    """A module imported on its first attribute access: dp_accounting pulls in scipy (seconds), which a run whose
    calibration is cached (workbench.cache) needs only for the epsilon it logs, computed off the training thread."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        module = importlib.import_module(self._name)
        self.__dict__.update(vars(module))  # later lookups skip __getattr__
        return getattr(module, attr)


dp_accounting = _Lazy("dp_accounting")
_pld = _Lazy("dp_accounting.pld.privacy_loss_distribution")
_plm = _Lazy("dp_accounting.pld.privacy_loss_mechanism")
_rdp = _Lazy("dp_accounting.rdp.rdp_privacy_accountant")
_vectorized = _Lazy("workbench.pld_losses")  # subclasses of dp_accounting's privacy losses


def code_version() -> str:
    """What a cached privacy result (workbench.cache) depends on besides its arguments."""
    from workbench import cache

    return cache.code_version(("privacy/__init__.py", "pld_losses.py"), ("dp-accounting", "opacus"))

ACCOUNTANTS = ("pld", "rdp", "prv")
SHARDS = ("per_rank", "global")

# PLD value discretization interval (the grid of privacy-loss values). Pessimistic rounding keeps every value an
# upper bound; a coarser grid is looser but faster. The looseness grows ~quadratically in the interval and linearly in
# the steps: at q=1e-3, sigma=1.37, 100k steps (epsilon ~0.99) it is +0.1% at 1e-4, +0.5% at 2e-4, +3% at 5e-4 and
# +13% at 1e-3 (where PLD would lose to PRV and even RDP). 2e-4 keeps PLD the tightest of the three while an epsilon
# of 100k Poisson steps takes 0.1-0.6 s and a calibration 0.3-3 s on 2 CPU cores (measured; see tests).
DEFAULT_PLD_DISCRETIZATION = 2e-4

# calibrate_noise searches sigma in this bracket. Below 0.3 DP-SGD gives next to no privacy and the PLD of a step
# becomes very wide (slow); above 1000 no useful training happens.
SIGMA_MIN = 0.3
SIGMA_MAX = 1000.0
# calibrate_noise returns a sigma within this relative distance above the smallest acceptable one.
SIGMA_RTOL = 2e-3

_STATE_KEYS = ("kind", "sample_rate", "noise_multiplier", "world_size", "shard", "pld_discretization", "steps")


# --------------------------------------------------------------------------------------------------- events


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_event_args(sample_rate: float, noise_multiplier: float, world_size: int, shard: str) -> None:
    if shard not in SHARDS:
        raise WorkbenchError(f"shard={shard!r} is unknown; choose one of {', '.join(SHARDS)}")
    if not (_is_int(world_size) and world_size >= 1):
        raise WorkbenchError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not (_is_real(sample_rate) and 0 < sample_rate <= 1):
        raise WorkbenchError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if not (_is_real(noise_multiplier) and 0 <= noise_multiplier < math.inf):
        raise WorkbenchError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")


def multiplicity_probs(world_size: int, sample_rate: float) -> list[float]:
    """P(K = k), k = 0..W, for K ~ Binomial(W, q_r): an example's multiplicity in one ``shard=global`` step."""
    w, q = int(world_size), float(sample_rate)
    return [math.comb(w, k) * q**k * (1.0 - q) ** (w - k) for k in range(w + 1)]


def _step_event(sample_rate: float, noise_multiplier: float, world_size: int, shard: str) -> dp_accounting.DpEvent:
    if shard == "per_rank" or world_size == 1:
        return dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    return dp_accounting.dp_event.MixtureOfGaussiansDpEvent(
        standard_deviation=noise_multiplier,
        sensitivities=[float(k) for k in range(world_size + 1)],
        sampling_probs=multiplicity_probs(world_size, sample_rate),
    )


def dp_event(sample_rate: float, noise_multiplier: float, steps: int, world_size: int = 1,
             shard: str = "per_rank") -> dp_accounting.DpEvent:
    """The ``dp_accounting`` event of ``steps`` logical DP-SGD steps.

    ``sample_rate`` is the per-rank Poisson rate (``q`` for per_rank, ``q_r`` for global); ``noise_multiplier`` is
    the total noise std in units of the clipping norm (noise is added once cluster-wide).
    """
    _check_event_args(sample_rate, noise_multiplier, world_size, shard)
    if not (_is_int(steps) and steps >= 0):
        raise WorkbenchError(f"steps must be an integer >= 0, got {steps!r}")
    return dp_accounting.SelfComposedDpEvent(_step_event(sample_rate, noise_multiplier, world_size, shard), int(steps))


# ------------------------------------------------------------------------------------- single-step PLDs


def _gaussian_pld(standard_deviation: float, sampling_prob: float,
                  value_discretization_interval: float) -> _pld.PrivacyLossDistribution:
    """``privacy_loss_distribution.from_gaussian_mechanism`` (its defaults, add-or-remove) with the fast inverse."""
    def pmf(adjacency):
        return _pld._create_pld_pmf_from_monotone_privacy_loss(  # pylint: disable=protected-access
            _vectorized._VectorizedGaussianPrivacyLoss(standard_deviation, sampling_prob=sampling_prob, adjacency_type=adjacency),
            pessimistic_estimate=True, value_discretization_interval=value_discretization_interval,
            use_connect_dots=True)

    try:
        if sampling_prob == 1.0:
            return _pld.PrivacyLossDistribution(pmf(_plm.AdjacencyType.REMOVE))
        return _pld.PrivacyLossDistribution(pmf(_plm.AdjacencyType.REMOVE), pmf(_plm.AdjacencyType.ADD))
    except AttributeError:  # dp_accounting internals moved: fall back to the (slower) public function
        return _pld.from_gaussian_mechanism(standard_deviation, sampling_prob=sampling_prob,
                                            value_discretization_interval=value_discretization_interval)


def _mixture_gaussian_pld(standard_deviation: float, sensitivities, sampling_probs,
                          value_discretization_interval: float) -> _pld.PrivacyLossDistribution:
    """``privacy_loss_distribution.from_mixture_gaussian_mechanism`` (its defaults) with the fast inverse."""
    try:
        pmfs = [
            _pld._create_pld_pmf_from_monotone_privacy_loss(  # pylint: disable=protected-access
                _vectorized._VectorizedMixtureGaussianPrivacyLoss(standard_deviation, sensitivities, sampling_probs,
                                                      pessimistic_estimate=True, adjacency_type=adjacency),
                pessimistic_estimate=True, value_discretization_interval=value_discretization_interval,
                use_connect_dots=True)
            for adjacency in (_plm.AdjacencyType.REMOVE, _plm.AdjacencyType.ADD)
        ]
    except AttributeError:  # dp_accounting internals moved: fall back to the (slow) public function
        return _pld.from_mixture_gaussian_mechanism(standard_deviation, sensitivities, sampling_probs,
                                                    value_discretization_interval=value_discretization_interval)
    return _pld.PrivacyLossDistribution(*pmfs)


def _step_pld(event: dp_accounting.DpEvent, d: float) -> _pld.PrivacyLossDistribution:
    """The PLD of one step, built exactly as ``PLDAccountant(value_discretization_interval=d)`` builds it."""
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        return _gaussian_pld(event.event.noise_multiplier, event.sampling_probability, d)
    return _mixture_gaussian_pld(event.standard_deviation, event.sensitivities, event.sampling_probs, d)


# ----------------------------------------------------------------------------------------------- accountant


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
        self._pld_step: _pld.PrivacyLossDistribution | None = None

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
            self._pld_step = _step_pld(_step_event(self.sample_rate, self.noise_multiplier, self.world_size, self.shard), d)
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
        shape of the curve) that guesses by regula falsi on log(epsilon) against log(T).
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
        # regula falsi (Illinois) on log(epsilon) - log(target) against log(T), on integers: lo meets, hi exceeds
        def gap(t: int) -> float:
            return math.log(max(self.epsilon(t, delta), 1e-300)) - math.log(target_epsilon)

        lo, hi = 1, upper
        g_lo, g_hi = gap(lo), gap(hi)
        side = 0
        while hi - lo > 1:
            a, b = math.log(lo), math.log(hi)
            x = b - g_hi * (b - a) / (g_hi - g_lo) if g_hi != g_lo else (a + b) / 2
            mid = min(max(round(math.exp(x)), lo + 1), hi - 1)
            g = gap(mid)
            if g <= 0:
                lo, g_lo = mid, g
                if side == -1:  # Illinois: the same end moved twice in a row, halve the other end's weight
                    g_hi /= 2
                side = -1
            else:
                hi, g_hi = mid, g
                if side == 1:
                    g_lo /= 2
                side = 1
        return lo

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


class EpsilonSchedule:
    """Epsilon at each of a run's logging steps, computed once, in step order, on a background thread.

    q, sigma and the step count are fixed before the first step, so the whole curve is known in advance: every logged
    line, the progress bar and the closing picture show the epsilon of their own step (each value is the accountant's
    own ``epsilon(step, delta)``, so the last one equals the reported final epsilon), and the training thread never
    waits for a PLD composition.
    """

    def __init__(self, accountant: "Accountant", delta: float, steps):
        import threading

        self.accountant, self.delta, self.steps = accountant, delta, sorted(set(steps))
        self._values: dict[int, float] = {}
        self._error: BaseException | None = None
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="workbench-epsilon-schedule", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        for step in self.steps:
            try:
                # A PLD composition is 0.1-0.5 s (and scipy's import under the first): a rerun of the same job reads
                # its schedule, the final epsilon included, from workbench's on-disk cache.
                value = self.accountant.epsilon(step, self.delta, on_disk=True)
            except BaseException as e:  # noqa: BLE001 - re-raised where a value is asked for
                with self._done:
                    self._error = e
                    self._done.notify_all()
                return
            with self._done:
                self._values[step] = value
                self._done.notify_all()

    def get(self, step: int, wait: bool = True) -> float | None:
        """Epsilon after ``step`` steps; with ``wait=False``, None while it is still being computed."""
        if step not in self._values and step not in self.steps:
            return self.accountant.epsilon(step, self.delta) if wait else None
        with self._done:
            if wait:
                self._done.wait_for(lambda: step in self._values or self._error is not None)
            if self._error is not None:
                raise RuntimeError("the epsilon schedule failed") from self._error
            return self._values.get(step)

    def latest(self, step: int) -> tuple[int, float] | None:
        """The newest (step, epsilon) already computed at or before ``step``, without waiting."""
        import bisect

        with self._done:
            i = bisect.bisect_right(self.steps, step) - 1
            if i >= 0 and self.steps[i] not in self._values:  # computed in step order: the newest so far is before it
                i = len(self._values) - 1
            return (self.steps[i], self._values[self.steps[i]]) if i >= 0 else None


# ---------------------------------------------------------------------------------------------- calibration


_GUESS_ORDERS = [*range(2, 65), 80, 96, 128, 192, 256]  # integer RDP orders: no fractional-order warnings


def _rdp_guess(sample_rate: float, steps: int, target_epsilon: float, delta: float, world_size: int,
               shard: str) -> float:
    """A cheap starting sigma (Poisson RDP on integer orders; ``global`` as Poisson at the mean multiplicity)."""
    q = sample_rate if shard == "per_rank" else min(1.0, world_size * sample_rate)

    def eps(sigma: float) -> float:
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        return _rdp.RdpAccountant(orders=_GUESS_ORDERS).compose(event).get_epsilon(delta)

    lo, hi = math.log(SIGMA_MIN), math.log(SIGMA_MAX)
    if eps(SIGMA_MIN) <= target_epsilon:
        return SIGMA_MIN
    if eps(SIGMA_MAX) > target_epsilon:
        return SIGMA_MAX
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if eps(math.exp(mid)) <= target_epsilon else (mid, hi)
    return math.exp(hi)


def calibrate_noise(kind: str, sample_rate: float, steps: int, target_epsilon: float, delta: float,
                    world_size: int = 1, shard: str = "per_rank", **accountant_kwargs) -> float:
    """The smallest sigma in [SIGMA_MIN, SIGMA_MAX] (to within a factor 1 + SIGMA_RTOL above it) for which
    ``Accountant(kind, sample_rate, sigma, world_size, shard, **accountant_kwargs)`` reports
    ``epsilon(steps, delta) <= target_epsilon``. Never overshoots: the returned sigma meets the target.

    Returns ``SIGMA_MIN`` when that already meets the target; raises ``WorkbenchError`` when ``SIGMA_MAX`` does not.
    Search: bracket around an RDP starting guess by growing multiplicative steps, then regula falsi (Illinois) on
    log(epsilon) vs log(sigma); typically 6-10 evaluations of the accountant.
    """
    if not (_is_real(target_epsilon) and 0 < target_epsilon < math.inf):
        raise WorkbenchError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    if not (_is_int(steps) and steps >= 1):
        raise WorkbenchError(f"steps must be an integer >= 1 to calibrate the noise, got {steps!r}")
    steps = int(steps)
    # validate kind / shard / q / W / delta / kwargs up front, before any work
    Accountant(kind, sample_rate, 1.0, world_size, shard, **accountant_kwargs).epsilon(0, delta)

    evals: dict[float, float] = {}

    def eps(sigma: float) -> float:
        if sigma not in evals:
            acc = Accountant(kind, sample_rate, sigma, world_size, shard, **accountant_kwargs)
            evals[sigma] = acc.epsilon(steps, delta)
        return evals[sigma]

    # bracket: lo misses the target, hi meets it
    sigma = _rdp_guess(sample_rate, steps, target_epsilon, delta, world_size, shard)
    factor = 1.1
    if eps(sigma) <= target_epsilon:
        hi, lo = sigma, None
        while lo is None:
            if hi == SIGMA_MIN:
                return SIGMA_MIN
            sigma = max(hi / factor, SIGMA_MIN)
            if eps(sigma) <= target_epsilon:
                hi = sigma
            else:
                lo = sigma
            factor **= 2
    else:
        lo, hi = sigma, None
        while hi is None:
            if lo == SIGMA_MAX:
                raise WorkbenchError(
                    f"target_epsilon={target_epsilon} is unreachable: even noise_multiplier={SIGMA_MAX:g} gives "
                    f"epsilon={eps(SIGMA_MAX):.4g} after {steps} steps at sample_rate={sample_rate:.6g} "
                    f"(delta={delta:g}, accountant={kind}, shard={shard}, world_size={world_size}); "
                    "take fewer steps or a smaller batch")
            sigma = min(lo * factor, SIGMA_MAX)
            if eps(sigma) <= target_epsilon:
                hi = sigma
            else:
                lo = sigma
            factor **= 2

    def gap(sigma: float) -> float:  # log(epsilon / target): > 0 misses, <= 0 meets
        return math.log(max(eps(sigma), 1e-300)) - math.log(target_epsilon)

    g_lo, g_hi = gap(lo), gap(hi)
    margin = 0.25 * math.log1p(SIGMA_RTOL)
    side = 0
    while hi / lo > 1 + SIGMA_RTOL:
        a, b = math.log(lo), math.log(hi)
        x = b - g_hi * (b - a) / (g_hi - g_lo) if g_lo != g_hi else (a + b) / 2
        sigma = math.exp(min(max(x, a + margin), b - margin))  # strictly inside: the bracket always shrinks
        g = gap(sigma)
        if g <= 0:
            hi, g_hi = sigma, g
            if side == 1:  # Illinois: the same end moved twice in a row, halve the other end's weight
                g_lo /= 2
            side = 1
        else:
            lo, g_lo = sigma, g
            if side == -1:
                g_hi /= 2
            side = -1
    if not eps(hi) <= target_epsilon:  # cannot happen: hi only ever takes values that met the target
        raise AssertionError(f"calibrate_noise overshot: epsilon({hi}) = {eps(hi)} > {target_epsilon}")
    return hi


# ------------------------------------------------------------------------------------------- argument checks


def default_delta(dataset_size: int) -> float:
    """A delta below 1/N: the power of ten at least 10x below 1/N, capped at 1e-5 (1e-5 for N=1437, 1e-6 for 60000)."""
    if not (_is_int(dataset_size) and dataset_size >= 1):
        raise WorkbenchError(f"dataset_size must be an integer >= 1, got {dataset_size!r}")
    return min(1e-5, 10.0 ** (-math.ceil(math.log10(int(dataset_size))) - 1))


def validate_privacy_args(target_epsilon: float | None, delta: float | None, noise_multiplier: float | None,
                          max_grad_norm: float, dataset_size: int) -> list[str]:
    """Raise ``WorkbenchError`` on an impossible privacy setting; return warnings (strings) for doubtful ones.

    ``target_epsilon``, ``delta`` and ``noise_multiplier`` may be None (not set).
    """
    warnings: list[str] = []
    if target_epsilon is not None and not (_is_real(target_epsilon) and target_epsilon > 0):
        raise WorkbenchError(f"target_epsilon must be > 0, got {target_epsilon!r}")
    if delta is not None and not (_is_real(delta) and 0 < delta < 1):
        raise WorkbenchError(f"delta must be in (0, 1), got {delta!r}")
    if not (_is_real(max_grad_norm) and 0 < max_grad_norm < math.inf):
        raise WorkbenchError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm!r}")
    if noise_multiplier is not None and not (_is_real(noise_multiplier) and 0 <= noise_multiplier < math.inf):
        raise WorkbenchError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    if not (_is_int(dataset_size) and dataset_size >= 1):
        raise WorkbenchError(f"dataset_size must be an integer >= 1, got {dataset_size!r}")
    if delta is not None and delta >= 1.0 / dataset_size:
        warnings.append(f"delta={delta:g} should be below 1/N={1.0 / dataset_size:.3g} (N={dataset_size}); "
                        f"e.g. {default_delta(dataset_size):g}")
    if noise_multiplier == 0:
        warnings.append("noise_multiplier=0 gives no privacy (epsilon=inf)")
    return warnings
