"""The mechanism of one run, built once from its settings: what the sampler draws, what clipping bounds, what the
noise adds and what the accountant accounts, in one object (in the spirit of jax_privacy's ``DPExecutionPlan``).

:func:`plan` is the one place that turns privacy settings into numbers: the population and the Poisson rate q (from
the shard), C, sigma (given, or calibrated to ``target_epsilon`` by the same accountant that reports), delta, and the
steps (cut to the last one within ``target_epsilon``). The run, a sweep bounding its candidates before any trains, the
step (its noise: :meth:`Mechanism.noise`), the loop, the checkpoint and the ``workbench.dp_event`` tag all read
:class:`Mechanism`; nothing re-derives q or sigma.

Each mechanism (``privacy.mechanism``) is one module of mechanisms/ registered in ``MECHANISMS`` (mechanisms/base.py's
:class:`~workbench.privacy.mechanisms.base.MechanismSpec`): its refusals, shard recut, calibration and plan, sampler,
DP event, accountant read back from the event, and noise. dpsgd (mechanisms/dpsgd.py), bandmf (correlated noise,
mechanisms/bandmf.py: cyclic Poisson, ceil(T / b) participations) and blt (mechanisms/blt.py: fixed batches, one
Gaussian of sigma / sens(T)); docs/DESIGN.md, "Adding a mechanism", says how to add one.

Adaptive clipping (``privacy.clipping=adaptive``, clipping/adaptive.py) is C's schedule within dpsgd: ``clipping`` is
the schedule GradientStep asks for C_t, the accountant accounts sigma exactly as for fixed C (the same event), and the
gradient noise is raised to sigma_g so that the gradient and the noised clipped count together are the Gaussian
mechanism of multiplier sigma.

:func:`mechanism_kind` is the one place that refuses a mechanism that is unknown, or a setting one does not support
(asking the mechanism's own refusals).
"""

from __future__ import annotations

from typing import Any

from workbench.errors import WorkbenchError
from workbench.privacy.accounting import Accountant, default_delta, validate_privacy_args
from workbench.privacy.mechanisms import MECHANISMS, Mechanism, MechanismSpec, register, spec_of
from workbench.privacy.mechanisms.base import clip_schedule
from workbench.privacy.sampling import Shard

__all__ = ["MECHANISMS", "Mechanism", "MechanismSpec", "accountant_of", "check_settings", "clip_schedule",
           "mechanism_kind", "plan", "recut", "register"]


def plan(p: Any, shard: Shard, shard_mode: str, world_size: int, steps: int, unit: str = "examples") -> Mechanism:
    """The mechanism of privacy settings ``p`` (``cfg.privacy``: enabled, max_grad_norm, noise_multiplier,
    target_epsilon, target_delta, accountant) over ``shard`` (of ``unit``: the notes' word) for ``steps`` planned
    steps. Raises WorkbenchError on settings that give no privacy or cannot be met."""
    if not p.enabled:
        return Mechanism(shard, shard_mode, world_size, steps)
    kind, size = mechanism_kind(p, shard_mode)
    shard = recut(p, shard, shard_mode, world_size)
    delta = p.target_delta if p.target_delta is not None else default_delta(shard.population)
    notes = validate_privacy_args(p.target_epsilon, delta, p.noise_multiplier, p.max_grad_norm, shard.population)
    return spec_of(kind).make(p, shard, shard_mode, world_size, steps, delta, notes, size, unit)


def recut(p: Any, shard: Shard, shard_mode: str, world_size: int) -> Shard:
    """The shard the mechanism of privacy settings ``p`` samples from: bandmf's b equal cyclic parts, blt's fixed
    batches, dpsgd's as it is. Refuses, in one line, a shard too small for them (b B / N > 1, say): the job asks it as
    soon as the shard is known, before the model, the data check or the calibration."""
    kind, size = mechanism_kind(p, shard_mode)
    return spec_of(kind).recut(shard, size, world_size)


def check_settings(cfg: Any, world_size: int = 1) -> None:
    """Refuse, before any work, a config whose mechanism is unknown or does not support its settings (what
    config.validate cannot ask from the layer below this one), nor its accountant the job's ``world_size`` and shard
    mode (the accountant's own refusal, asked as calibration asks it)."""
    p = cfg.privacy
    if p.enabled:
        kind, _ = mechanism_kind(p, cfg.ddp_shard)
        spec_of(kind).check_accountant(p, world_size, cfg.ddp_shard)
    else:
        spec_of(p.get("mechanism", "dpsgd"))


def mechanism_kind(p: Any, shard_mode: str) -> tuple[str, int]:
    """(privacy.mechanism, b or d) of privacy settings ``p``, refusing in one line what is unknown, gives no privacy or
    is not accounted: the one place for these refusals (config.validate's callers ask it before any work; plan asks it
    again). What a mechanism does not support is its own module's refusal (MechanismSpec.size)."""
    get = p.get if hasattr(p, "get") else lambda k, d=None: getattr(p, k, d)
    kind = get("mechanism", "dpsgd")
    spec = spec_of(kind)
    if get("noise_multiplier") == 0:
        raise WorkbenchError("privacy.noise_multiplier=0 gives no privacy; use privacy.enabled=false for a non-private run")
    size = spec.size(get, shard_mode)
    if get("unit", "example") != "example" and not spec.user_level:
        raise WorkbenchError(f"privacy.mechanism={kind} supports privacy.unit=example only (its sampling over users "
                             "is not built); use privacy.mechanism=dpsgd or bandmf for user-level DP")
    return kind, size


def accountant_of(fields: dict[str, Any], kind: str = "pld") -> Accountant:
    """The accountant of a run's ``workbench.dp_event`` fields (Mechanism.event_fields), by the mechanism it names
    (dpsgd's when it names none)."""
    return spec_of(fields.get("mechanism", "dpsgd")).accountant_of(fields, kind)
