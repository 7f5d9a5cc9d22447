"""The structured config: one schema, Hugging Face ``TrainingArguments`` names, validated before any work.

Hydra composes ``conf/`` on top of :class:`WorkbenchConfig`, so a typo'd key or a wrong type is refused by Hydra itself;
:func:`validate` then checks values and cross-field rules and raises :class:`WorkbenchError` with one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from workbench.errors import WorkbenchError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
GRAD_SAMPLE_MODES = ("auto", "bk", "hooks", "functorch", "ew", "ghost")
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


@dataclass
class PrivacyConfig:
    enabled: bool = True
    accountant: str = "pld"  # pld | rdp | prv
    target_epsilon: Optional[float] = 8.0
    target_delta: Optional[float] = None  # None: a value below 1/N (see workbench.privacy.default_delta)
    noise_multiplier: Optional[float] = None  # None: calibrated so that target_epsilon is met after all steps
    max_grad_norm: float = 1.0
    grad_sample_mode: str = "auto"  # auto: the fastest mode that supports the model (workbench.clipping)
    # Replace layers DP-SGD cannot handle by their DP equivalents (workbench.models.prepare_model); false: refuse them.
    fix_model: bool = True
    # The secret that the Poisson-sampling and noise streams derive from (with seed / data_seed, rank and step).
    # null: a fresh random secret per run, kept in its checkpoints (so a resumed run replays exactly) and never logged.
    # Set it only to reproduce a run bit for bit: whoever knows it can strip the noise and see the batches, so the
    # reported epsilon does not hold against them. MLflow shows it redacted.
    secure_seed: Optional[int] = None


@dataclass
class AuditConfig:
    enabled: bool = False  # audit=canaries: the one-run privacy audit (workbench/audit.py)
    canaries: int = 1000
    significance: float = 0.05


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: Optional[str] = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db
    experiment_name: str = "workbench"
    run_name: Optional[str] = None
    log_checkpoints: bool = True
    tags: Dict[str, str] = field(default_factory=dict)
    # Set by launchers and sweeps, rarely by hand: continue this MLflow run; the multirun folder (-> parent run).
    run_id: Optional[str] = None
    sweep_dir: Optional[str] = None


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
    audit: AuditConfig = field(default_factory=AuditConfig)
    callbacks: List[Any] = field(default_factory=list)  # Hydra `_target_` objects (workbench/callbacks.py)

    # Hugging Face TrainingArguments names.
    output_dir: Optional[str] = None  # None: Hydra's run dir from the CLI, else ./outputs/<timestamp>
    seed: int = 42
    data_seed: Optional[int] = None
    per_device_train_batch_size: int = 256  # expected per-process Poisson batch
    per_device_eval_batch_size: int = 512
    max_physical_batch_size: int = 512  # bounds memory only
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
    resume_from_checkpoint: Optional[str] = None  # a path, or "latest" (newest under output_dir)
    disable_tqdm: bool = False
    log_on_each_node: bool = True
    save_on_each_node: bool = False

    # Mixed precision (autocast) for forward and backward; norms, clipping, the sum and the noise stay float32.
    bf16: bool = False  # CPU and CUDA
    fp16: bool = False  # CUDA only

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


def _positive(cfg: DictConfig, *names: str) -> None:
    for name in names:
        value = OmegaConf.select(cfg, name)
        if value is not None and value <= 0:
            raise WorkbenchError(f"{name} must be > 0, got {value}")


def validate(cfg: DictConfig) -> None:
    """Check values and cross-field rules. Raises WorkbenchError (one line) on the first problem."""
    for knob in REFUSED_KNOBS:
        if cfg.get(knob) is not None:
            raise WorkbenchError(
                f"{knob} is refused: it conflicts with Poisson sampling, which draws every batch itself "
                "(the privacy accounting depends on it); remove the setting"
            )
    _positive(cfg, "per_device_train_batch_size", "per_device_eval_batch_size", "max_physical_batch_size",
              "learning_rate", "logging_steps", "eval_steps", "save_steps", "ddp_timeout", "privacy.max_grad_norm",
              "privacy.target_epsilon")
    if cfg.max_steps <= 0 and cfg.num_train_epochs <= 0:
        raise WorkbenchError(f"set max_steps > 0 or num_train_epochs > 0 (got {cfg.max_steps}, {cfg.num_train_epochs})")
    if cfg.save_total_limit is not None and cfg.save_total_limit < 1:
        raise WorkbenchError(f"save_total_limit must be >= 1 or null, got {cfg.save_total_limit}")
    if cfg.warmup_steps < 0 or cfg.dataloader_num_workers < 0 or cfg.weight_decay < 0:
        raise WorkbenchError("warmup_steps, dataloader_num_workers and weight_decay must be >= 0")
    if cfg.lr_scheduler_type not in LR_SCHEDULERS:
        raise WorkbenchError(f"lr_scheduler_type={cfg.lr_scheduler_type!r} is unknown; choose one of {', '.join(LR_SCHEDULERS)}")
    if cfg.ddp_shard not in SHARD_MODES:
        raise WorkbenchError(f"ddp_shard={cfg.ddp_shard!r} is unknown; choose one of {', '.join(SHARD_MODES)}")
    if cfg.dataloader_num_workers == 0 and (cfg.dataloader_prefetch_factor is not None or cfg.dataloader_persistent_workers):
        raise WorkbenchError("dataloader_prefetch_factor and dataloader_persistent_workers need dataloader_num_workers > 0")
    p = cfg.privacy
    if p.grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise WorkbenchError(f"privacy.grad_sample_mode={p.grad_sample_mode!r} is unknown; choose one of {', '.join(GRAD_SAMPLE_MODES)}")
    if p.enabled and p.noise_multiplier is None and p.target_epsilon is None:
        raise WorkbenchError("privacy needs privacy.noise_multiplier or privacy.target_epsilon (or privacy.enabled=false)")
    if p.noise_multiplier is not None and p.noise_multiplier < 0:
        raise WorkbenchError(f"privacy.noise_multiplier must be >= 0, got {p.noise_multiplier}")
    if p.target_delta is not None and not 0 < p.target_delta < 1:
        raise WorkbenchError(f"privacy.target_delta must be in (0, 1), got {p.target_delta}")
    if p.accountant not in ("pld", "rdp", "prv"):
        raise WorkbenchError(f"privacy.accountant={p.accountant!r} is unknown; choose one of pld, rdp, prv")
    if cfg.bf16 and cfg.fp16:
        raise WorkbenchError("bf16=true and fp16=true: choose one precision")
    if cfg.audit.canaries < 1 or not 0 < cfg.audit.significance < 1:
        raise WorkbenchError(f"audit.canaries must be >= 1 and audit.significance in (0, 1), got "
                             f"{cfg.audit.canaries} and {cfg.audit.significance}")
    if cfg.launcher.nprocs is not None and cfg.launcher.nprocs < 1:
        raise WorkbenchError(f"launcher.nprocs must be >= 1, got {cfg.launcher.nprocs}")
    if cfg.launcher.name not in ("inline", "local", "slurm"):
        raise WorkbenchError(f"launcher.name={cfg.launcher.name!r} is unknown; choose one of inline, local, slurm")


def record_choices(cfg: DictConfig, choices: Dict[str, Any]) -> None:
    """Keep the Hydra group choices in the config itself (tags "hydra/<group>"), so that a job without a HydraConfig
    (launched, resumed, composed in a notebook) still tags its run and knows which option each group came from.
    Tag keys avoid dots (OmegaConf reads them as paths)."""
    with open_dict(cfg):
        for k, v in choices.items():
            if v is not None and not k.startswith("hydra/"):
                cfg.tracking.tags.setdefault(f"hydra/{k}", str(v))


def own_arguments(cfg: DictConfig, path: str) -> Any:
    """The node at ``path`` (``model``, ``data.train``, ``data.eval``, ``data.collator``) as its ``_target_`` receives
    it. When the user points ``_target_`` at another class than the chosen option's (``model._target_=my_pkg.MyNet``),
    the option's arguments still at the option's values are not passed to it; arguments set or added by the user
    (``+model.width=3``) are. So one override swaps the class without deleting the old class's keys."""
    node = OmegaConf.select(cfg, path)
    group, _, sub = path.partition(".")
    choice = cfg.tracking.tags.get(f"hydra/{group}")
    option_file = CONF_DIR / group / f"{choice}.yaml"
    if not isinstance(node, DictConfig) or choice is None or not option_file.is_file():
        return node
    option = OmegaConf.load(option_file)
    option = OmegaConf.select(option, sub) if sub else option
    if not isinstance(option, DictConfig) or option.get("_target_") == node.get("_target_"):
        return node
    own = OmegaConf.create(OmegaConf.to_container(node, resolve=True))
    for key in list(own.keys()):
        if key != "_target_" and key in option and own[key] == option[key]:
            del own[key]
    return own


def resolve_output_dir(cfg: DictConfig) -> Path:
    """The run folder: the configured one, else Hydra's run dir (CLI), else ./outputs/<timestamp>."""
    if cfg.output_dir is None:
        try:
            from hydra.core.hydra_config import HydraConfig

            cfg.output_dir = HydraConfig.get().runtime.output_dir
        except ValueError:  # not inside a Hydra app (notebook, API)
            cfg.output_dir = str(Path("outputs") / time.strftime("%Y-%m-%d/%H-%M-%S"))
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
    for name in PRIVACY_FIELDS:
        value = OmegaConf.select(cfg, name)  # a sub-node resolves its interpolations (${data.task}) against the root
        values[name] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]
