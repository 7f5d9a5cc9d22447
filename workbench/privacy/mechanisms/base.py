"""What every mechanism shares: the run's :class:`Mechanism` (the plan), the registry ``MECHANISMS`` of the
mechanisms' specs by name, and :class:`MechanismSpec`, the interface each mechanism's module implements (its
refusals, its shard recut, its calibration and ``make``, its sampler, its DP event, its accountant read back from
that event, its noise). The plan's methods ask its spec, found by ``kind`` in ``MECHANISMS``: nothing outside a
mechanism's own module dispatches on its name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from workbench import cache
from workbench.errors import WorkbenchError
from workbench.privacy.accounting import Accountant, code_version
from workbench.privacy.clipping.adaptive import AdaptiveClip, FixedClip
from workbench.privacy.blt import BLT
from workbench.privacy.sampling import Shard

Get = Callable[..., Any]  # privacy settings' get(key, default)


class MechanismSpec:
    """One mechanism (``privacy.mechanism=<name>``): subclass it in one module and ``register`` an instance. The
    defaults are what a mechanism that says nothing gets: no setting of its own, example level only, correlated
    (not independent) noise, zero-out adjacency."""

    name = ""
    user_level = False  # privacy.unit=user runs it (users.py's samplers: cyclic Poisson for bandmf, else Poisson)
    independent_noise = False  # each step's noise is N(0, (sigma C)^2), independent of the others' (DP-AdamBC)

    def size(self, get: Get, shard_mode: str) -> int:
        """This mechanism's refusals of settings it does not support (in one line, before any work), and its one
        integer setting (b, d; 1 where it has none)."""
        return 1

    def check_accountant(self, p: Any, world_size: int, shard_mode: str) -> None:
        """Refuse, from the config alone, what its accountant does not account (the world size, the shard mode)."""

    def recut(self, shard: Shard, size: int, world_size: int) -> Shard:
        """The shard it samples from (refusing, in one line, one too small for it)."""
        return shard

    def make(self, p: Any, shard: Shard, shard_mode: str, world_size: int, steps: int, delta: float,
             notes: list[str], size: int, unit: str) -> "Mechanism":
        """The calibrated plan over the recut ``shard``: sigma (given, or calibrated to target_epsilon), the
        accountant, the steps cut to the budget, C's schedule."""
        raise NotImplementedError

    def sampler(self, m: "Mechanism", seed: int, rank: int, start_step: int) -> Any:
        raise NotImplementedError

    def event_fields(self, m: "Mechanism") -> dict[str, Any]:
        """What the ``workbench.dp_event`` tag adds to the common fields, enough for :meth:`accountant_of`."""
        return {"mechanism": self.name}

    def accountant_of(self, fields: dict[str, Any], kind: str) -> Accountant:
        """The accountant of a run's ``workbench.dp_event`` fields (a sweep composes what its runs spent)."""
        raise NotImplementedError

    def noise(self, m: "Mechanism", numel: int, rank: int, device: torch.device | str, seed: int,
              dtype: torch.dtype) -> Any:
        """The step's gradient noise (noise.GaussianNoise's interface: ``seed``, ``clip``, ``adds``, ``add_``),
        sigma_g C per coordinate, added by rank 0 alone."""
        raise NotImplementedError

    def whole_set_poisson(self, m: "Mechanism") -> bool:
        """Adding or removing one unit leaves every other unit's draws as they were (see Mechanism.adjacency)."""
        return False


MECHANISMS: dict[str, MechanismSpec] = {}  # privacy.mechanism -> its spec, in the order registered


def register(spec: MechanismSpec) -> MechanismSpec:
    """Make ``spec`` the mechanism ``privacy.mechanism=<spec.name>`` runs."""
    MECHANISMS[spec.name] = spec
    return spec


def spec_of(kind: Any) -> MechanismSpec:
    """The registered mechanism ``kind``, refused in one line when there is none."""
    if kind not in MECHANISMS:
        raise WorkbenchError(f"privacy.mechanism={kind!r} is unknown; choose one of {', '.join(MECHANISMS)}")
    return MECHANISMS[kind]


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
    kind: str = "dpsgd"  # privacy.mechanism: its spec in MECHANISMS (dpsgd | bandmf | blt | one registered)
    num_bands: int = 1  # b (bandmf): the cyclic parts and the strategy's bands; blt: k, the fixed batches per epoch
    # bandmf: c_0..c_{b-1}, unit norm (correlated.py); blt: its BLT (blt.py); None: independent noise
    strategy: tuple[float, ...] | BLT | None = None

    unit = "example"  # what one neighbouring change is of (users.py's UserMechanism: "user")

    def __post_init__(self) -> None:
        if self.clipping is None and self.private:
            self.clipping = FixedClip(self.max_grad_norm)

    @property
    def spec(self) -> MechanismSpec:
        return spec_of(self.kind)

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
        return f"{'add-or-remove' if self.spec.whole_set_poisson(self) else 'zero-out'} one {self.unit}"

    def sampler(self, seed: int, rank: int, start_step: int = 0) -> Any:
        """The batches of steps [start_step, steps) on ``rank``, from the secret sampling seed."""
        return self.spec.sampler(self, seed, rank, start_step)

    def noise(self, numel: int, rank: int, device: torch.device | str = "cpu", seed: int = 0,
              dtype: torch.dtype = torch.float32) -> Any:
        """The gradient noise the step adds to its flat update of ``numel`` parameters (None: not private)."""
        return self.spec.noise(self, numel, rank, device, seed, dtype) if self.private else None

    def epsilon(self, steps: int) -> float:
        """Epsilon at delta after ``steps`` steps (cached on disk: a rerun reads it back)."""
        return self.accountant.epsilon(steps, self.delta, on_disk=True)

    def event_fields(self) -> dict[str, Any]:
        """The run's mechanism as its ``workbench.dp_event`` MLflow tag records it (read back by workbench/sweep/
        through its spec's accountant_of)."""
        if not self.private:
            return {"private": False}
        a = self.accountant
        fields = dict(sample_rate=a.sample_rate, noise_multiplier=a.noise_multiplier, world_size=a.world_size,
                      shard=a.shard, planned_steps=self.steps, delta=self.delta, adjacency=self.adjacency)
        if self.adaptive:  # the same event; how its noise is split between the gradient and the count
            fields.update(clipping="adaptive", gradient_noise_multiplier=self.gradient_noise_multiplier,
                          clip_count_noise=self.clipping.count_noise)
        fields.update(self.spec.event_fields(self))
        return fields


def budget(p: Any, accountant: Accountant, delta: float, steps: int, notes: list[str]) -> int:
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


def clip_schedule(p: Any, expected_batch: int) -> FixedClip | AdaptiveClip:
    """C's schedule of privacy settings ``p``: fixed C, or adaptive clipping from C = max_grad_norm (clipping/adaptive.py;
    ``clip_count_noise`` null: the paper's B/20)."""
    kind = p.get("clipping", "fixed") if hasattr(p, "get") else getattr(p, "clipping", "fixed")
    if kind == "fixed":
        return FixedClip(p.max_grad_norm)
    if kind != "adaptive":
        raise WorkbenchError(f"privacy.clipping={kind!r} is unknown; choose fixed or adaptive")
    return AdaptiveClip(p.max_grad_norm, p.target_quantile, p.clip_learning_rate, p.clip_count_noise, expected_batch)


def correlated_settings(kind: str, key: str, what: str, get: Get, shard_mode: str, most: int | None = None) -> int:
    """The refusals bandmf and blt share: their size ``privacy.<key>`` an integer in [1, most], shard=per_rank (the
    ``what`` sampling is over each rank's shard), fixed C. Returns the size."""
    size = get(key, 4)
    if not (isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= (most or size)):
        raise WorkbenchError(f"privacy.{key} must be an integer >= 1{f' and <= {most}' if most else ''}, "
                             f"got {size!r}")
    if shard_mode != "per_rank":
        raise WorkbenchError(f"privacy.mechanism={kind} supports ddp_shard=per_rank only ({what} over each rank's "
                             "shard); shard=global is not analysed for it")
    if get("clipping", "fixed") != "fixed":
        raise WorkbenchError(f"privacy.mechanism={kind} supports privacy.clipping=fixed only (adaptive clipping's "
                             "accounting with correlated noise is not built)")
    return int(size)
