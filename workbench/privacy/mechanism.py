"""The mechanism of one run, built once from its settings: what the sampler draws, what clipping bounds, what the
noise adds and what the accountant accounts, in one object (in the spirit of jax_privacy's ``DPExecutionPlan``).

:func:`plan` is the one place that turns privacy settings into numbers: the population and the Poisson rate q (from
the shard), C, sigma (given, or calibrated to ``target_epsilon`` by the same accountant that reports), delta, and the
steps (cut to the last one within ``target_epsilon``). The run, a sweep bounding its candidates before any trains, the
step, the loop, the checkpoint and the ``workbench.dp_event`` tag all read :class:`Mechanism`; nothing re-derives q or
sigma. Other mechanisms (correlated noise, adaptive clipping, user-level units) are other plans of this shape.

Adaptive clipping (``privacy.clipping=adaptive``, clipping/adaptive.py) is such a plan: ``clipping`` is the schedule
GradientStep asks for C_t, the accountant accounts sigma exactly as for fixed C (the same event), and the gradient
noise is raised to sigma_g so that the gradient and the noised clipped count together are the Gaussian mechanism of
multiplier sigma.

Correlated noise (``privacy.mechanism=bandmf``, correlated.py) is another: the shard recut into b cyclic parts and the
in-band rate p (cyclic.py), the b-banded strategy's coefficients (``strategy``, for the step's noise), and the
accountant of amplified BandMF (accounting/banded.py): ceil(T / b) participations, calibrated and cut the same way.
BLT (``privacy.mechanism=blt``, blt.py) is a third: the shard recut into k fixed batches walked cyclically
(cyclic.FixedBatchSampler), the BLT for (T, k, d) as ``strategy``, and accounting/blt.py's accountant (one Gaussian
of multiplier sigma / sens(T), no amplification).

:func:`mechanism_kind` is the one place that refuses a mechanism that is unknown, or a setting one does not support.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


from workbench import cache
from workbench.errors import WorkbenchError
from workbench.privacy.accounting import (Accountant, calibrate_noise, code_version, default_delta,
                                          validate_privacy_args)
from workbench.privacy.accounting.banded import BandMFAccountant, participations
from workbench.privacy.accounting.blt import BLTAccountant, calibrate_blt
from workbench.privacy.blt import BLT, check_blt
from workbench.privacy.blt import strategy as blt_strategy
from workbench.privacy.clipping.adaptive import AdaptiveClip, FixedClip
from workbench.privacy.correlated import MECHANISMS
from workbench.privacy.correlated import strategy as banded_strategy
from workbench.privacy.cyclic import CyclicPoissonBatchSampler, FixedBatchSampler, banded_shard, fixed_batch_shard
from workbench.privacy.sampling import PoissonBatchSampler, Shard


@dataclass
class Mechanism:
    """DP-SGD with Poisson sampling over ``shard``, per-example clipping to C and Gaussian noise sigma C, ``steps``
    logical steps on ``world_size`` ranks. Not private (``accountant is None``): no clipping, no noise."""

    shard: Shard  # this rank's examples, the population N and the per-rank Poisson rate q
    shard_mode: str  # per_rank | global
    world_size: int
    steps: int  # the planned logical steps, within target_epsilon
    max_grad_norm: float | None = None  # C (adaptive clipping: the initial C); None: not private
    noise_multiplier: float = 0.0  # sigma, the accounted multiplier
    delta: float | None = None
    accountant: Accountant | None = None  # of exactly (q, sigma, W, shard_mode); its state is the run's spend so far
    notes: list[str] = field(default_factory=list)  # warnings about doubtful settings, for the user
    clipping: FixedClip | AdaptiveClip | None = None  # C_t's schedule, asked by the step (None: not private)
    kind: str = "dpsgd"  # dpsgd | bandmf | blt (privacy.mechanism)
    num_bands: int = 1  # b (bandmf): the cyclic parts and the strategy's bands; blt: k, the fixed batches per epoch
    # bandmf: c_0..c_{b-1}, unit norm (correlated.py); blt: its BLT (blt.py); None: independent noise
    strategy: tuple[float, ...] | BLT | None = None

    unit = "example"  # what one neighbouring change is of (users.py's UserMechanism: "user")

    def __post_init__(self) -> None:
        if self.clipping is None and self.private:
            self.clipping = FixedClip(self.max_grad_norm)

    @property
    def private(self) -> bool:
        return self.accountant is not None

    @property
    def adaptive(self) -> bool:
        return self.clipping is not None and self.clipping.adaptive

    @property
    def gradient_noise_multiplier(self) -> float:
        """sigma_g, the gradient noise's multiplier: sigma for fixed C; raised for adaptive clipping, so that with the
        count's noise the mechanism is the Gaussian of multiplier sigma (clipping/adaptive.py)."""
        return self.clipping.gradient_noise(self.noise_multiplier) if self.private else 0.0

    @property
    def sample_rate(self) -> float:
        return self.shard.sample_rate

    @property
    def expected_batch(self) -> int:
        """B: every step's clipped noised sum is divided by it, never by the realised batch."""
        return self.shard.expected_batch

    @property
    def adjacency(self) -> str | None:
        """The neighbouring relation epsilon holds for, as the ``privacy_adjacency`` MLflow tag says it (None: not
        private). "add-or-remove one example" only where adding or removing one leaves every other example's draws
        as they were: independent Poisson over the whole set, dpsgd with ``shard=global`` or one process (q = B / N
        taken as public, as the accounting takes it). Elsewhere the sampler fixes what an example does by its index:
        ``per_rank`` on W > 1 ranks cuts a tail of N mod W by index, bandmf's cyclic part is its index mod b, blt's
        batches are a permutation of the trimmed shard, each of public size, so one example more or less moves
        others. What holds there is "zero-out": N fixed, one example replaced by one that contributes nothing (no
        gradient, no clipped count). Both give the same epsilon: dp_accounting's PLD and RDP of these events are the
        same under ADD_OR_REMOVE_ONE and REPLACE_SPECIAL (tests/test_adjacency.py)."""
        if not self.private:
            return None
        whole_set_poisson = self.kind == "dpsgd" and (self.shard_mode == "global" or self.world_size == 1)
        return f"{'add-or-remove' if whole_set_poisson else 'zero-out'} one {self.unit}"

    def sampler(self, seed: int, rank: int, start_step: int = 0) -> Any:
        """The batches of steps [start_step, steps) on ``rank``, from the secret sampling seed."""
        if self.kind == "blt":
            return FixedBatchSampler(self.shard, self.world_size, self.steps, seed, rank, start_step)
        if self.kind == "bandmf":
            return CyclicPoissonBatchSampler(self.shard, self.num_bands, self.steps, seed, rank, start_step)
        return PoissonBatchSampler(self.shard, self.steps, seed, rank, start_step)

    def epsilon(self, steps: int) -> float:
        """Epsilon at delta after ``steps`` steps (cached on disk: a rerun reads it back)."""
        return self.accountant.epsilon(steps, self.delta, on_disk=True)

    def event_fields(self) -> dict[str, Any]:
        """The run's mechanism as its ``workbench.dp_event`` MLflow tag records it (read back by workbench/sweep/)."""
        if not self.private:
            return {"private": False}
        a = self.accountant
        fields = dict(sample_rate=a.sample_rate, noise_multiplier=a.noise_multiplier, world_size=a.world_size,
                      shard=a.shard, planned_steps=self.steps, delta=self.delta, adjacency=self.adjacency)
        if self.adaptive:  # the same event; how its noise is split between the gradient and the count
            fields.update(clipping="adaptive", gradient_noise_multiplier=self.gradient_noise_multiplier,
                          clip_count_noise=self.clipping.count_noise)
        if self.kind == "bandmf":  # accounting/banded.py's accountant_of reads these back
            fields.update(mechanism="bandmf", num_bands=self.num_bands)
        if self.kind == "blt":  # the accountant's whole event: its BLT, k and the T its sensitivity was computed for
            fields.update(mechanism="blt", min_sep=a.min_sep, buf_decay=list(a.blt.buf_decay),
                          output_scale=list(a.blt.output_scale), strategy_steps=a.planned_steps)
        return fields


def plan(p: Any, shard: Shard, shard_mode: str, world_size: int, steps: int, unit: str = "examples") -> Mechanism:
    """The mechanism of privacy settings ``p`` (``cfg.privacy``: enabled, max_grad_norm, noise_multiplier,
    target_epsilon, target_delta, accountant) over ``shard`` (of ``unit``: the notes' word) for ``steps`` planned
    steps. Raises WorkbenchError on settings that give no privacy or cannot be met."""
    if not p.enabled:
        return Mechanism(shard, shard_mode, world_size, steps)
    kind, bands = mechanism_kind(p, shard_mode)
    shard = recut(p, shard, shard_mode, world_size)
    delta = p.target_delta if p.target_delta is not None else default_delta(shard.population)
    notes = validate_privacy_args(p.target_epsilon, delta, p.noise_multiplier, p.max_grad_norm, shard.population)
    if kind == "blt":
        return _plan_blt(p, shard, shard_mode, world_size, steps, delta, notes, bands)
    # bandmf's T steps cost DP-SGD's ceil(T / b) (accounting/banded.py): calibrated as those, same accountant
    counted = participations(steps, bands) if kind == "bandmf" else steps
    sigma = p.noise_multiplier if p.noise_multiplier is not None else cache.cached(
        "calibrate_noise", lambda: calibrate_noise(p.accountant, shard.sample_rate, counted, p.target_epsilon, delta,
                                                   world_size, shard_mode),
        kind=p.accountant, sample_rate=shard.sample_rate, steps=counted, target_epsilon=p.target_epsilon,
        delta=delta, world_size=world_size, shard=shard_mode, code=code_version())
    accountant = BandMFAccountant(p.accountant, shard.sample_rate, sigma, bands, world_size, shard_mode) \
        if kind == "bandmf" else Accountant(p.accountant, shard.sample_rate, sigma, world_size, shard_mode)
    steps = _budget(p, accountant, delta, steps, notes)
    clip = clip_schedule(p, shard.expected_batch)
    clip.gradient_noise(sigma)  # refused here, before any run exists, when the count's noise is too small
    if kind == "bandmf":
        dropped = shard.dropped
        if dropped:
            notes.append(f"privacy.mechanism=bandmf uses {shard.population} {unit} ({dropped} dropped) so that each "
                         f"rank's shard splits into {bands} equal cyclic parts")
        coefficients = cache.cached("bandmf_strategy", lambda: banded_strategy(bands, steps), num_bands=bands,
                                    steps=steps, code=cache.code_version(("privacy/correlated.py",), ("scipy",)))
        return Mechanism(shard, shard_mode, world_size, steps, p.max_grad_norm, sigma, delta, accountant, notes, clip,
                         "bandmf", bands, tuple(coefficients))
    return Mechanism(shard, shard_mode, world_size, steps, p.max_grad_norm, sigma, delta, accountant, notes, clip)


def _plan_blt(p: Any, shard: Shard, shard_mode: str, world_size: int, steps: int, delta: float, notes: list[str],
              buffers: int) -> Mechanism:
    """BLT's plan (blt.py): k fixed batches, the BLT for (T, k, d), sigma for target_epsilon after T steps. Its
    epsilon grows with t through sens(t), so the budget stop is only ever at T itself (a given sigma may cut it)."""
    k = round(1 / shard.sample_rate)
    blt = check_blt(*cache.cached("blt_strategy", lambda: _blt_params(buffers, steps, k), buffers=buffers,
                                  steps=steps, min_sep=k, code=cache.code_version(("privacy/blt.py",), ("scipy",))),
                    buffers)
    sigma = p.noise_multiplier if p.noise_multiplier is not None else cache.cached(
        "calibrate_blt", lambda: calibrate_blt(p.accountant, blt, k, steps, p.target_epsilon, delta, world_size),
        kind=p.accountant, blt=[blt.buf_decay, blt.output_scale], min_sep=k, steps=steps,
        target_epsilon=p.target_epsilon, delta=delta, world_size=world_size, code=code_version())
    accountant = BLTAccountant(p.accountant, sigma, blt, k, steps, world_size, shard_mode)
    steps = _budget(p, accountant, delta, steps, notes)
    if shard.dropped:
        notes.append(f"privacy.mechanism=blt uses {shard.population} examples ({shard.dropped} dropped) so that each "
                     f"rank's shard splits into {k} fixed batches of {shard.expected_batch // world_size}")
    return Mechanism(shard, shard_mode, world_size, steps, p.max_grad_norm, sigma, delta, accountant, notes,
                     clip_schedule(p, shard.expected_batch), "blt", k, blt)


def _budget(p: Any, accountant: Accountant, delta: float, steps: int, notes: list[str]) -> int:
    """The planned steps cut to the last one within target_epsilon (the budget stop), said in ``notes``."""
    if p.target_epsilon is None:
        return steps
    budget = cache.cached("max_steps", lambda: accountant.max_steps(p.target_epsilon, delta, steps),
                          accountant=accountant.state_dict(), target_epsilon=p.target_epsilon, delta=delta,
                          upper=steps, code=code_version())
    if budget == 0:
        raise WorkbenchError(f"privacy.target_epsilon={p.target_epsilon} is exceeded by the first step at "
                             f"noise_multiplier={accountant.noise_multiplier}; raise the noise or the target")
    if budget < steps:
        notes.append(f"the run stops after {budget} of {steps} steps: one more would exceed "
                     f"target_epsilon={p.target_epsilon}")
        steps = budget
    return steps


def _blt_params(buffers: int, steps: int, min_sep: int) -> list[list[float]]:
    blt = blt_strategy(buffers, steps, min_sep)
    return [list(blt.buf_decay), list(blt.output_scale)]


def recut(p: Any, shard: Shard, shard_mode: str, world_size: int) -> Shard:
    """The shard the mechanism of privacy settings ``p`` samples from: bandmf's b equal cyclic parts, blt's fixed
    batches, dpsgd's as it is. Refuses, in one line, a shard too small for them (b B / N > 1, say): the job asks it as
    soon as the shard is known, before the model, the data check or the calibration."""
    kind, bands = mechanism_kind(p, shard_mode)
    if kind == "bandmf":
        return banded_shard(shard, bands, world_size)
    if kind == "blt":
        return fixed_batch_shard(shard, world_size)
    return shard


def check_settings(cfg: Any, world_size: int = 1) -> None:
    """Refuse, before any work, a config whose mechanism is unknown or does not support its settings (what
    config.validate cannot ask from the layer below this one), nor its accountant the job's ``world_size`` and shard
    mode (the accountant's own refusal, asked as calibration asks it)."""
    p = cfg.privacy
    if p.enabled:
        kind, _ = mechanism_kind(p, cfg.ddp_shard)
        if kind == "dpsgd":
            Accountant(p.accountant, 1.0, 1.0, world_size, cfg.ddp_shard)
    elif p.get("mechanism", "dpsgd") not in MECHANISMS:
        raise WorkbenchError(f"privacy.mechanism={p.mechanism!r} is unknown; choose one of {', '.join(MECHANISMS)}")


def mechanism_kind(p: Any, shard_mode: str) -> tuple[str, int]:
    """(privacy.mechanism, b or d) of privacy settings ``p``, refusing in one line what is unknown, gives no privacy or
    is not accounted: the one place for these refusals (config.validate's callers ask it before any work; plan asks it
    again)."""
    get = p.get if hasattr(p, "get") else lambda k, d=None: getattr(p, k, d)
    kind = get("mechanism", "dpsgd")
    if kind not in MECHANISMS:
        raise WorkbenchError(f"privacy.mechanism={kind!r} is unknown; choose one of {', '.join(MECHANISMS)}")
    if get("noise_multiplier") == 0:
        raise WorkbenchError("privacy.noise_multiplier=0 gives no privacy; use privacy.enabled=false for a non-private run")
    if kind == "dpsgd":
        return kind, 1
    key, what = ("num_bands", "cyclic Poisson") if kind == "bandmf" else ("blt_buffers", "fixed batches")
    size = get(key, 4)
    if not (isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= (16 if kind == "blt" else size)):
        raise WorkbenchError(f"privacy.{key} must be an integer >= 1{' and <= 16' if kind == 'blt' else ''}, "
                             f"got {size!r}")
    if shard_mode != "per_rank":
        raise WorkbenchError(f"privacy.mechanism={kind} supports ddp_shard=per_rank only ({what} over each rank's "
                             "shard); shard=global is not analysed for it")
    if get("clipping", "fixed") != "fixed":
        raise WorkbenchError(f"privacy.mechanism={kind} supports privacy.clipping=fixed only (adaptive clipping's "
                             "accounting with correlated noise is not built)")
    if kind == "blt" and get("unit", "example") != "example":  # bandmf's cyclic Poisson runs over users (users.py)
        raise WorkbenchError("privacy.mechanism=blt supports privacy.unit=example only (its fixed batches over users "
                             "are not built); use privacy.mechanism=dpsgd or bandmf for user-level DP")
    return kind, int(size)


def clip_schedule(p: Any, expected_batch: int) -> FixedClip | AdaptiveClip:
    """C's schedule of privacy settings ``p``: fixed C, or adaptive clipping from C = max_grad_norm (clipping/adaptive.py;
    ``clip_count_noise`` null: the paper's B/20)."""
    kind = p.get("clipping", "fixed") if hasattr(p, "get") else getattr(p, "clipping", "fixed")
    if kind == "fixed":
        return FixedClip(p.max_grad_norm)
    if kind != "adaptive":
        raise WorkbenchError(f"privacy.clipping={kind!r} is unknown; choose fixed or adaptive")
    return AdaptiveClip(p.max_grad_norm, p.target_quantile, p.clip_learning_rate, p.clip_count_noise, expected_batch)
