"""The structured config: one schema, Hugging Face ``TrainingArguments`` names, validated before any work.

Hydra composes ``conf/`` on top of :class:`WorkbenchConfig` (a typo'd key or a wrong type fails there; the API's
``compose`` turns that into one line); :func:`validate` then checks keys added with ``+``, every numeric range,
interpolations and cross-field rules, and raises :class:`WorkbenchError` with one line.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
from datetime import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from workbench.errors import WorkbenchError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
GRAD_SAMPLE_MODES = ("auto", "bk", "hooks", "functorch", "ew", "vmap")  # Opacus' ghost: refused (clipping/opacus_modes.py)
SHARD_MODES = ("per_rank", "global")

# Accelerate knobs that change how batches are formed. Poisson sampling decides every batch itself, so each would
# silently break the privacy accounting: refused, never ignored.
REFUSED_KNOBS = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler")

# Fields whose change alters the privacy guarantee: a checkpoint from a run that differs in any of them is refused.
PRIVACY_FIELDS = (
    "per_device_train_batch_size", "max_steps", "num_train_epochs", "seed", "data_seed", "ddp_shard",
    "privacy.enabled", "privacy.accountant", "privacy.target_epsilon", "privacy.target_delta",
    "privacy.noise_multiplier", "privacy.max_grad_norm", "privacy.secure_seed", "data", "audit",
)
USER_FIELDS = ("privacy.unit", "privacy.max_examples_per_user")  # digested when privacy.unit=user
ADAPTIVE_FIELDS = ("privacy.clipping", "privacy.target_quantile", "privacy.clip_learning_rate",  # digested when
                   "privacy.clip_count_noise")  # privacy.clipping=adaptive: fixed-C digests stay as they were
BANDMF_FIELDS = ("privacy.mechanism", "privacy.num_bands", "privacy.blt_buffers")  # digested when not dpsgd: dpsgd digests stay as they were


@dataclass
class PrivacyConfig:
    enabled: bool = True
    accountant: str = "pld"  # pld | rdp | prv
    mechanism: str = "dpsgd"  # dpsgd | bandmf (correlated noise, workbench/privacy/correlated.py) | blt (privacy/blt.py)
    num_bands: int = 4  # bandmf: b, the strategy's bands and the cyclic Poisson parts (b B / N must be <= 1)
    blt_buffers: int = 4  # blt: d, the BLT's buffers (its noise keeps d + 1 model-sized vectors)
    target_epsilon: Optional[float] = 8.0
    target_delta: Optional[float] = None  # None: a value below 1/N (see workbench.privacy.default_delta)
    noise_multiplier: Optional[float] = None  # None: calibrated so that target_epsilon is met after all steps
    max_grad_norm: float = 1.0  # C; with clipping=adaptive, the initial C
    clipping: str = "fixed"  # fixed | adaptive: C follows target_quantile (workbench/privacy/clipping/adaptive.py)
    target_quantile: float = 0.5  # adaptive: the fraction of examples left unclipped that C aims at
    clip_learning_rate: float = 0.2  # adaptive: eta_C of the geometric update C <- C exp(-eta_C (b - target_quantile))
    clip_count_noise: Optional[float] = None  # adaptive: sigma_b, the clipped count's noise; None: expected batch / 20
    grad_sample_mode: str = "auto"  # auto: the fastest mode that supports the model (workbench.privacy.clipping)
    # Replace layers DP-SGD cannot handle by their DP equivalents (workbench.models.prepare_model); false: refuse them.
    fix_model: bool = True
    # The secret that the Poisson-sampling and noise streams derive from (with seed / data_seed, rank and step).
    # null: a fresh random secret per run, kept in its checkpoints (so a resumed run replays exactly) and never logged.
    # Set it only to reproduce a run bit for bit: whoever knows it can strip the noise and see the batches, so the
    # reported epsilon does not hold against them. MLflow shows it redacted.
    secure_seed: Optional[int] = None
    # The unit of privacy: example, or user (workbench/privacy/users.py; data.user_key names each example's user).
    unit: str = "example"
    max_examples_per_user: int = 16  # unit=user: k, the most examples a drawn user contributes


@dataclass
class AuditConfig:
    enabled: bool = False  # audit=canaries: the one-run privacy audit (workbench/privacy/auditing/)
    canaries: int = 1000
    significance: float = 0.05


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: Optional[str] = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db
    experiment_name: str = "workbench"
    run_name: Optional[str] = None
    log_checkpoints: bool = True
    # Seconds the end of a run waits for a dead server; then unsent calls go to <output_dir>/tracking-spool/ (sync)
    flush_timeout: float = 30.0
    tags: Dict[str, str] = field(default_factory=dict)
    log_model: bool = True  # the trained model as the run's MLflow model, the privacy budget as its tags
    log_model_checkpoints: bool = False  # also at each save_steps checkpoint: an MLflow model at its step and epsilon
    register_model: Optional[str] = None  # NAME: also a new version of registered model NAME (budget as version tags)
    system_metrics_interval: float = 10.0  # seconds between MLflow's system-metrics samples on rank 0; 0: off
    # The raw training loss: None logs it only for non-private runs (a private run's loss is an exact statistic of its
    # batch, not covered by epsilon); true also for private runs (tagged non_dp_metrics=loss); false never.
    log_train_loss: Optional[bool] = None
    run_id: Optional[str] = None  # set by launchers, rarely by hand: continue this MLflow run
    sweep_dir: Optional[str] = None  # set by sweeps: the multirun folder (-> the parent run)


@dataclass
class SweepConfig:
    """What a multirun sweep's parent run reports (workbench/sweep/)."""

    metrics: Dict[str, str] = field(default_factory=lambda: {"eval_accuracy": "max"})  # best point by: max | min
    # all: every point may be published (cost: sweep_epsilon_all). random_stopping: the driver runs K trials, K drawn
    # from `trials` (poisson: mean poisson_mean; truncated_negative_binomial: tnb_eta, tnb_gamma), each a uniformly
    # drawn point, and only the best is published (cost: sweep_epsilon_best, Papernot & Steinke 2022).
    tuning: str = "all"
    trials: str = "poisson"
    poisson_mean: float = 3.0
    tnb_eta: float = 0.0
    tnb_gamma: float = 0.2
    seed: Optional[int] = None  # the draw of K and of the points (None: fresh randomness)


@dataclass
class LauncherConfig:
    name: str = "inline"  # inline | local | slurm
    nprocs: Optional[int] = None  # local: processes on this machine (None: one per GPU, else 2)
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: Optional[int] = None  # None: gpus_per_node when GPUs are asked for, else 1
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[float] = None
    timeout_min: int = 60
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    setup: List[str] = field(default_factory=list)
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    max_num_timeout: int = 3
    wait: bool = True


@dataclass
class WorkbenchConfig:
    # What to train (Hydra `_target_` objects, so a user's own Dataset / nn.Module plugs in by config).
    data: Any = MISSING  # {train: {_target_...}, eval: {_target_...}}
    model: Any = MISSING
    optimizer: Any = MISSING  # partial: learning_rate and weight_decay are passed in
    criterion: Any = MISSING  # must accept reduction="none"
    peft: Any = None  # peft=lora: adapters wrap the model (workbench.hf.lora)
    compute_metrics: Optional[str] = "workbench.metrics.accuracy"

    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    callbacks: List[Any] = field(default_factory=list)  # Hydra `_target_` objects (workbench/callbacks.py)

    # Hugging Face TrainingArguments names.
    output_dir: Optional[str] = None  # None: Hydra's run dir from the CLI, else ./outputs/<timestamp>
    seed: int = 42
    data_seed: Optional[int] = None
    per_device_train_batch_size: int = 256  # expected per-process Poisson batch
    per_device_eval_batch_size: int = 512
    max_physical_batch_size: Any = 512  # bounds memory only; auto: the largest that fits (README, micro-batches)
    physical_batch_memory: Optional[float] = None  # MiB, for max_physical_batch_size=auto on CPU (None: 1/4 of free)
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    num_train_epochs: float = 1.0
    max_steps: int = -1
    warmup_steps: int = 0
    lr_scheduler_type: str = "constant"
    logging_steps: int = 10
    eval_steps: Optional[int] = None  # None: evaluate once, at the end
    save_steps: Optional[int] = None  # None: one checkpoint, at the end
    save_total_limit: Optional[int] = 2
    # A path, "latest" (newest under output_dir; refused when there is none) or "latest_or_new" (the same, or a fresh
    # start: for requeued jobs). Without it, an output_dir that holds checkpoints is refused.
    resume_from_checkpoint: Optional[str] = None
    disable_tqdm: bool = False
    log_on_each_node: bool = True
    save_on_each_node: bool = False

    # Mixed precision (autocast) for forward and backward; norms, clipping, the sum and the noise stay float32.
    bf16: bool = False  # CPU and CUDA
    fp16: bool = False  # CUDA only
    # fp16's fixed loss scale S (not dynamic: README's mixed precision). An example whose fp16 backward overflows at
    # this S contributes 0 to its step, silently (the count is private): lower S when gradients are large.
    fp16_loss_scale: float = 1024.0

    # Distributed.
    ddp_backend: str = "auto"
    ddp_timeout: int = 1800
    ddp_shard: str = "per_rank"
    eval_use_gather_object: bool = False
    batch_eval_metrics: bool = False

    # DataLoader parity.
    dataloader_drop_last: bool = False  # eval loader only: training batches are Poisson
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    dataloader_prefetch_factor: Optional[int] = None
    dataloader_persistent_workers: bool = False

    # Refused (see REFUSED_KNOBS); present so that setting one gets a reason, not "key not in struct".
    split_batches: Optional[bool] = None
    dispatch_batches: Optional[bool] = None
    even_batches: Optional[bool] = None
    use_seedable_sampler: Optional[bool] = None


def register() -> None:
    ConfigStore.instance().store(name="workbench_schema", node=WorkbenchConfig)
    # ${workbench_pid:} in hydra.run.dir: with microseconds, a run folder no other run on this machine shares.
    OmegaConf.register_new_resolver("workbench_pid", os.getpid, replace=True)


# Nodes whose keys are a user object's own keyword arguments (a model's, dataset's, optimizer's, criterion's) or
# free-form maps: `+key=value` may add to them. Everywhere else a key must be part of the schema.
USER_OBJECTS = ("data", "model", "optimizer", "criterion")  # the nodes whose keys are a user object's arguments
FREE_FORM = (*USER_OBJECTS, "tracking.tags", "launcher.additional_parameters")

SEED_MAX = 2**32 - 1  # numpy's (and so Hugging Face's set_seed) limit
STEPS_MAX = 10**9  # far beyond any run; above it the accountant and the step streams would not finish


@dataclass(frozen=True)
class Range:
    low: float
    high: float = math.inf
    low_open: bool = False  # low itself refused
    high_open: bool = False

    def describe(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"

    def holds(self, value: float) -> bool:
        return ((value > self.low if self.low_open else value >= self.low)
                and (value < self.high if self.high_open else value <= self.high))


# Every numeric knob and what it accepts (null stays allowed where the schema says Optional). NaN and inf never pass.
RANGES = {
    "seed": Range(0, SEED_MAX), "data_seed": Range(0, SEED_MAX),
    "per_device_train_batch_size": Range(1), "per_device_eval_batch_size": Range(1), "max_physical_batch_size": Range(1),
    "physical_batch_memory": Range(0, low_open=True),
    "learning_rate": Range(0, low_open=True), "weight_decay": Range(0),
    "num_train_epochs": Range(0), "max_steps": Range(-1, STEPS_MAX), "warmup_steps": Range(0, STEPS_MAX),
    "logging_steps": Range(1), "eval_steps": Range(1), "save_steps": Range(1), "save_total_limit": Range(1),
    "fp16_loss_scale": Range(0, 2**15, low_open=True),  # above it the gradient at the logits overflows fp16 (65504)
    "ddp_timeout": Range(1), "dataloader_num_workers": Range(0), "dataloader_prefetch_factor": Range(1),
    "privacy.target_epsilon": Range(0, low_open=True), "privacy.target_delta": Range(0, 1, low_open=True, high_open=True),
    "privacy.noise_multiplier": Range(0), "privacy.max_grad_norm": Range(0, low_open=True),
    "privacy.target_quantile": Range(0, 1, low_open=True, high_open=True),
    "privacy.clip_learning_rate": Range(0, low_open=True), "privacy.clip_count_noise": Range(0, low_open=True),
    "privacy.secure_seed": Range(0, 2**63 - 1), "privacy.max_examples_per_user": Range(1),
    "privacy.num_bands": Range(1, STEPS_MAX),
    "privacy.blt_buffers": Range(1, 16),
    "audit.canaries": Range(1), "audit.significance": Range(0, 1, low_open=True, high_open=True),
    "sweep.poisson_mean": Range(0), "sweep.tnb_eta": Range(-1, low_open=True),
    "sweep.tnb_gamma": Range(0, 1, low_open=True, high_open=True), "sweep.seed": Range(0, SEED_MAX),
    "launcher.nprocs": Range(1), "launcher.nodes": Range(1), "launcher.gpus_per_node": Range(0),
    "launcher.tasks_per_node": Range(1), "launcher.cpus_per_task": Range(1), "launcher.mem_gb": Range(0, low_open=True),
    "launcher.timeout_min": Range(1), "launcher.max_num_timeout": Range(0),
    "tracking.flush_timeout": Range(0), "tracking.system_metrics_interval": Range(0),  # seconds; nan, inf: no end
}


def schema_keys(schema: type = None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (for suggestions)."""
    keys = []
    for name, kind in get_type_hints(schema or WorkbenchConfig).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(kind):
            keys += schema_keys(kind, f"{prefix}{name}.")
    return keys


def unknown_key(key: str) -> WorkbenchError:
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in schema_keys() if k.rpartition(".")[0] == parent]
    close = [k for k in siblings if k.startswith(leaf) or leaf.startswith(k)] or \
        difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
    return WorkbenchError(f"unknown key {key!r}{hint} (the schema is workbench/config.py; new keys are taken only "
                          f"under {', '.join(FREE_FORM)})")


def check_keys(cfg: DictConfig, schema: type = WorkbenchConfig, prefix: str = "") -> None:
    """Refuse keys added outside the free-form nodes (`+privacy.epsilon=3` would otherwise be silently ignored) and
    schema keys removed with `~key`."""
    hints = get_type_hints(schema)
    for key in cfg.keys():
        if key not in hints:
            raise unknown_key(prefix + str(key))
    for name, kind in hints.items():
        if name not in cfg:
            raise WorkbenchError(f"{prefix}{name} cannot be removed (~{prefix}{name}): the schema needs it; set it instead")
        if dataclasses.is_dataclass(kind):
            node = cfg._get_node(name)
            if isinstance(node, DictConfig) and not node._is_none() and not node._is_interpolation():
                check_keys(node, kind, f"{prefix}{name}.")


def _check_resolvable(cfg: DictConfig) -> None:
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        where = f"{e.full_key}: " if getattr(e, "full_key", None) else ""
        if "HydraConfig was not set" in str(e):  # ${hydra:...} resolves only inside the Hydra app: checked there
            return
        cause = str(e).splitlines()[0].replace("KeyError raised while resolving interpolation: ", "")
        raise WorkbenchError(f"{where}cannot resolve {cause}") from None


def _check_ranges(cfg: DictConfig) -> None:
    for name, allowed in RANGES.items():
        value = OmegaConf.select(cfg, name)
        if value is None or (name == "max_physical_batch_size" and value == "auto"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WorkbenchError(f"{name} must be a number{' or auto' if name == 'max_physical_batch_size' else ''}, "
                                 f"got {value!r}")
        if not math.isfinite(value):
            raise WorkbenchError(f"{name} must be a finite number {allowed.describe()}, got {value}")
        if not allowed.holds(value):
            raise WorkbenchError(f"{name} must be {allowed.describe()}, got {value}")


def _check_sweep(cfg: DictConfig) -> None:
    """Random stopping's K must be in the range of the theorems that bound it, and its trials independent
    (workbench/sweep/)."""
    check_trial_streams(cfg)
    mu = OmegaConf.select(cfg, "sweep.poisson_mean")
    if isinstance(mu, (int, float)) and not isinstance(mu, bool) and mu < 1:
        # Papernot & Steinke's Theorem 6 has a log(mu) term: below 1 it would make the bound smaller than one run's.
        raise WorkbenchError(f"sweep.poisson_mean must be >= 1, got {mu}: Papernot & Steinke's Poisson bound "
                             "(Theorem 6) holds for a mean of at least 1 (below, its log(mu) term is negative)")


def check_trial_streams(cfg: DictConfig) -> None:
    """Random stopping's best-of-K bound assumes K independent trials: a pinned secret would give a point drawn twice
    the same batches and noise (and every point the same streams). Refused; the sweep driver asks it of each point."""
    if (OmegaConf.select(cfg, "sweep.tuning") == "random_stopping" and OmegaConf.select(cfg, "privacy.enabled")
            and OmegaConf.select(cfg, "privacy.secure_seed") is not None):
        raise WorkbenchError("sweep.tuning=random_stopping with a pinned privacy.secure_seed: its trials would draw the "
                             "same batches and noise, not the independent trials the best-of-K bound assumes; leave "
                             "privacy.secure_seed unset (a fresh secret per trial)")


def check_shared_streams(points: List[DictConfig]) -> None:
    """Points of one sweep that pin the same privacy.secure_seed and seed draw the same noise: two such releases'
    noise can cancel (their clipped sums at C1 and C2 minus each other's scaled noise); points that draw the same
    batches (the same secret and data_seed, or seed) with independent noise are one sampled Gaussian of multiplier
    sigma / sqrt(2), not two. Neither is what the composition covers: refused; a sweep leaves the secret unset (a
    fresh one per point) or gives each point its own."""
    seen: Dict[Any, int] = {}
    for i, cfg in enumerate(points):
        secret = OmegaConf.select(cfg, "privacy.secure_seed")
        if not OmegaConf.select(cfg, "privacy.enabled") or secret is None:
            continue
        data_seed = OmegaConf.select(cfg, "data_seed")
        for stream, key in (("noise", (secret, cfg.seed)), ("batches", (secret, data_seed if data_seed is not None
                                                                          else cfg.seed))):  # job.py's two streams
            if (stream, key) in seen:
                raise WorkbenchError(f"sweep points {seen[stream, key] + 1} and {i + 1} pin the same "
                                     f"privacy.secure_seed and draw the same {stream} (seed, data_seed): not the "
                                     "independent releases the sweep's composed epsilon covers; leave "
                                     "privacy.secure_seed unset (a fresh secret per point)")
            seen[stream, key] = i


def validate(cfg: DictConfig) -> None:
    """Check keys, values and cross-field rules. Raises WorkbenchError (one line) on the first problem."""
    check_keys(cfg)
    _check_resolvable(cfg)
    for knob in REFUSED_KNOBS:
        if cfg.get(knob) is not None:
            raise WorkbenchError(
                f"{knob} is refused: it conflicts with Poisson sampling, which draws every batch itself "
                "(the privacy accounting depends on it); remove the setting"
            )
    _check_sweep(cfg)
    _check_ranges(cfg)
    for path in ("model", "peft", "criterion", "optimizer", "data.train", "data.eval", "data.collator"):
        node = OmegaConf.select(cfg, path)  # e.g. ~peft on a preset that still sets peft.target_modules
        if isinstance(node, DictConfig) and len(node) and "_target_" not in node:
            raise WorkbenchError(f"{path} names no _target_ to build (it holds only {', '.join(map(str, node))}); set "
                                 f"{path}._target_, or remove it with its keys ({' '.join(f'~{path}.{k}' for k in node)})")
    if cfg.max_steps <= 0 and cfg.num_train_epochs <= 0:
        raise WorkbenchError(f"set max_steps > 0 or num_train_epochs > 0 (got {cfg.max_steps}, {cfg.num_train_epochs})")
    if cfg.lr_scheduler_type not in LR_SCHEDULERS:
        raise WorkbenchError(f"lr_scheduler_type={cfg.lr_scheduler_type!r} is unknown; choose one of {', '.join(LR_SCHEDULERS)}")
    if cfg.ddp_shard not in SHARD_MODES:
        raise WorkbenchError(f"ddp_shard={cfg.ddp_shard!r} is unknown; choose one of {', '.join(SHARD_MODES)}")
    if cfg.dataloader_num_workers == 0 and (cfg.dataloader_prefetch_factor is not None or cfg.dataloader_persistent_workers):
        raise WorkbenchError("dataloader_prefetch_factor and dataloader_persistent_workers need dataloader_num_workers > 0")
    p = cfg.privacy
    if p.grad_sample_mode == "ghost" and p.enabled:  # why: workbench/privacy/clipping/opacus_modes.py
        raise WorkbenchError("privacy.grad_sample_mode=ghost is refused: Opacus' ghost clipping cannot bound each "
                             "example's contribution in floating point; use bk (one backward, no per-sample "
                             "gradients) or auto")
    if p.grad_sample_mode not in GRAD_SAMPLE_MODES + ("ghost",):
        raise WorkbenchError(f"privacy.grad_sample_mode={p.grad_sample_mode!r} is unknown; choose one of {', '.join(GRAD_SAMPLE_MODES)}")
    if p.enabled and p.noise_multiplier is None and p.target_epsilon is None:
        raise WorkbenchError("privacy needs privacy.noise_multiplier or privacy.target_epsilon (or privacy.enabled=false)")
    if p.clipping not in ("fixed", "adaptive"):
        raise WorkbenchError(f"privacy.clipping={p.clipping!r} is unknown; choose one of fixed, adaptive")
    _check_unit(cfg)
    # The mechanism's own refusals (unknown, shard, clipping, unit) are workbench/privacy/mechanism.py's
    # mechanism_kind, asked by config.validate's callers (a layer above this one) right after it.
    if p.accountant not in ("pld", "rdp", "prv"):
        raise WorkbenchError(f"privacy.accountant={p.accountant!r} is unknown; choose one of pld, rdp, prv")
    if cfg.bf16 and cfg.fp16:
        raise WorkbenchError("bf16=true and fp16=true: choose one precision")
    if cfg.launcher.name not in ("inline", "local", "slurm"):
        raise WorkbenchError(f"launcher.name={cfg.launcher.name!r} is unknown; choose one of inline, local, slurm")
    name = cfg.tracking.register_model  # a name the Model Registry takes (MLflow refuses others only at the end)
    if name is not None and (not str(name).strip() or any(c in str(name) for c in "/:%\\") or str(name) == ".."):
        raise WorkbenchError(f"tracking.register_model={name!r} is not a registered model name: none of / : % \\")
    asks = "register_model" if name is not None else "log_model_checkpoints" if cfg.tracking.log_model_checkpoints else 0
    if asks and not cfg.tracking.log_model:
        raise WorkbenchError(f"tracking.{asks} needs tracking.log_model=true (it logs the model)")


def _check_unit(cfg: DictConfig) -> None:
    """privacy.unit=user (workbench/privacy/users.py): what it needs, and what it does not support yet."""
    p = cfg.privacy
    if p.unit not in ("example", "user"):
        raise WorkbenchError(f"privacy.unit={p.unit!r} is unknown; choose example or user")
    if p.unit != "user":
        return
    why = ("privacy.enabled=false (a non-private baseline has no unit: add privacy.unit=example)" if not p.enabled else
           "grad_sample_mode=bk (it never forms the per-example gradients a user's mean is made of)"
           if p.grad_sample_mode == "bk" else None)
    if why:
        raise WorkbenchError(f"privacy.unit=user does not support {why}")
    if OmegaConf.select(cfg, "data.user_key") is None:
        raise WorkbenchError("privacy.unit=user needs data.user_key: the dataset attribute, example field or "
                             "_target_ callable giving each example's user")
    if cfg.max_physical_batch_size == "auto":
        raise WorkbenchError("privacy.unit=user does not support max_physical_batch_size=auto (a user's examples must "
                             "share one micro-batch of a size known before training); set a number")
    if p.max_examples_per_user > cfg.max_physical_batch_size:
        raise WorkbenchError(f"privacy.max_examples_per_user={p.max_examples_per_user} is more than "
                             f"max_physical_batch_size={cfg.max_physical_batch_size}: a user's examples share one "
                             "micro-batch; raise max_physical_batch_size or lower the cap")


def resolve_output_dir(cfg: DictConfig) -> Path:
    """The run folder: the configured one, else Hydra's run dir (CLI), else ./outputs/<timestamp>."""
    if cfg.output_dir is None:
        try:
            from hydra.core.hydra_config import HydraConfig

            cfg.output_dir = HydraConfig.get().runtime.output_dir
        except ValueError:  # not inside a Hydra app (notebook, API)
            # Unique even for runs started in the same second (Hydra's folder has the same suffix: conf/config.yaml).
            cfg.output_dir = str(Path("outputs") / datetime.now().strftime(f"%Y-%m-%d/%H-%M-%S-%f-{os.getpid()}"))
    path = Path(cfg.output_dir).expanduser().resolve()
    return path


def check_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise WorkbenchError(f"output_dir {str(path)!r} is not writable: {e.strerror or e}") from None


def privacy_digest(cfg: DictConfig, world_size: int) -> str:
    """A digest of the fields that change the privacy guarantee (see PRIVACY_FIELDS) and the world size."""
    values: dict[str, Any] = {"world_size": world_size}
    adaptive = OmegaConf.select(cfg, "privacy.clipping") == "adaptive"
    users = OmegaConf.select(cfg, "privacy.unit") == "user"
    banded = OmegaConf.select(cfg, "privacy.mechanism") not in (None, "dpsgd")
    for name in (PRIVACY_FIELDS + (ADAPTIVE_FIELDS if adaptive else ()) + (USER_FIELDS if users else ())
                 + (BANDMF_FIELDS if banded else ())):
        value = OmegaConf.select(cfg, name)  # a sub-node resolves its interpolations (${data.task}) against the root
        values[name] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]
