"""The job a config describes, built before anything trains: everything that can be refused is refused here, before
an MLflow run exists (config, data, model, the mechanism, the pre-run check of the clipping strategy, a resume).

:func:`build` returns a typed :class:`Job`; workbench/run.py runs it.
"""

from __future__ import annotations

import inspect
import logging
import math
import secrets
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from hydra._internal.utils import _locate  # what instantiate locates a _target_ with (get_object also logs its error)
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig
from torch import nn

from workbench import callbacks as callbacks_
from workbench import checkpoint, config, distributed, overrides
from workbench.data import loaders
from workbench.data import users as data_users
from workbench.data.checks import check_fit
from workbench.errors import WorkbenchError
from workbench.models import hf
from workbench.models.fixing import prepare_model
from workbench.privacy import mechanism, sampling
from workbench.privacy import users
from workbench.privacy.clipping.opacus_modes import EW_MIXED_PRECISION
from workbench.privacy.mechanism import Mechanism
from workbench.step import CHECK_EXAMPLES, GradientStep
from workbench.user_step import UserGradientStep
from workbench.trainer import lr_lambda
from workbench.world_size import planned_world_size

if TYPE_CHECKING:
    from workbench.privacy.auditing.canaries import CanaryAudit

log = logging.getLogger("workbench")


@dataclass
class Job:
    """One rank's built job."""

    model: nn.Module  # the user's model, fixed for DP where asked: what checkpoints hold
    criterion: nn.Module
    mechanism: Mechanism  # sampling, clipping, noise and accounting of this run
    step_fn: GradientStep
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: Any  # the training batches, from the mechanism's sampler
    eval_loader: Any | None
    metrics_fn: Callable | None
    callbacks: callbacks_.CallbackList
    collator: Callable | None
    autocast_dtype: torch.dtype | None
    secret: int  # the stream secret: in the run folder's checkpoints, never in MLflow
    digest: str  # the privacy config's hash: a resume must match it
    start_step: int = 0
    resume_run_id: str | None = None
    canaries: CanaryAudit | None = None
    fixed_modules: list[str] = field(default_factory=list)


def _instantiate(node: Any, what: str, **kwargs) -> Any:
    try:
        return instantiate(node, **kwargs)
    except Exception as e:  # noqa: BLE001 - Hydra wraps the user's error; show its first line
        own = e.__cause__ if isinstance(e.__cause__, WorkbenchError) else None  # ours already says it in one line
        msg = str(own) if own else " ".join(str(e).split())[:500] or type(e).__name__
        raise WorkbenchError(f"could not build {what}: {msg}") from e


def _compute_metrics(name: str | None) -> Callable | None:
    if name is None:
        return None
    try:
        return get_method(name)
    except Exception:  # noqa: BLE001
        raise WorkbenchError(f"compute_metrics={name!r} is not an importable function") from None


def training_sets(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """The user's training set, the one trained on (with the audit's canary slots, which join the population: N and q
    count them whatever their membership) and the audit (or None)."""
    train_set = _instantiate(overrides.own_arguments(cfg, "data.train"), "data.train")
    if not cfg.audit.enabled:
        return train_set, train_set, None
    from workbench.privacy.auditing.canaries import CanaryAudit

    canaries = CanaryAudit(cfg.audit.canaries, train_set, cfg.audit.significance)
    return train_set, canaries.dataset, canaries


def planned_steps(cfg: DictConfig, population: int, world_size: int) -> int:
    expected_batch = cfg.per_device_train_batch_size * world_size
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * population / expected_batch)
    if total_steps > config.STEPS_MAX:
        raise WorkbenchError(f"num_train_epochs={cfg.num_train_epochs} makes {total_steps} steps, more than "
                             f"{config.STEPS_MAX}; lower it or set max_steps")
    return total_steps


def planned_mechanism(cfg: DictConfig) -> dict[str, Any]:
    """What a run of `cfg` would spend, from its config alone (the training set is built for its size, nothing
    trains): the fields of its ``workbench.dp_event`` tag, or ``{"private": False}``. The world size is the one its
    launcher asks for. Raises WorkbenchError when the run would be refused."""
    world_size = planned_world_size(cfg)
    user_set, train_set, canaries = training_sets(cfg)
    _, index = user_index(cfg, user_set, canaries)
    return mechanism_of(cfg, loaders.check_dataset(train_set, "training"), 0, world_size, index).event_fields()


def user_index(cfg: DictConfig, train_set: Any, canaries: CanaryAudit | None = None
               ) -> tuple[Any, users.UserIndex | None]:
    """privacy.unit=user: the user's training set as the model sees it (without a user field) and its users
    (workbench/privacy/users.py), then, with ``canaries``, the audit's canary users (one per slot, after the data's
    users); otherwise the set as it is and None."""
    if cfg.privacy.unit != "user":
        return train_set, None
    key = cfg.data.get("user_key")
    by_example = _instantiate(key, "data.user_key", _partial_=True) if isinstance(key, DictConfig) else None
    ids, seen = data_users.user_ids(train_set, key, by_example)
    seed = cfg.data_seed if cfg.data_seed is not None else cfg.seed
    index = users.index_users(ids, cfg.privacy.max_examples_per_user, seed)
    if canaries is not None:
        if seen is not canaries.dataset.base:  # the canary slots sit after the examples the model sees
            raise WorkbenchError("audit=canaries with privacy.unit=user needs the user id as a dataset attribute or a "
                                 "_target_ callable, not a field of the examples")
        index = canaries.users(index)
    return seen, index


def mechanism_of(cfg: DictConfig, dataset_size: int, rank: int, world_size: int,
                 index: users.UserIndex | None = None) -> Mechanism:
    """The mechanism `cfg` runs on this rank over a training set of ``dataset_size`` examples (or ``index``'s users)."""
    if index is not None:
        shard = users.user_shard(index, rank, world_size, cfg.ddp_shard, cfg.per_device_train_batch_size)
        steps = planned_steps(cfg, shard.population, world_size)
        return users.plan_users(cfg.privacy, index, shard, cfg.ddp_shard, world_size, steps)
    shard = sampling.train_shard(dataset_size, rank, world_size, cfg.ddp_shard, cfg.per_device_train_batch_size)
    return mechanism.plan(cfg.privacy, shard, cfg.ddp_shard, world_size, planned_steps(cfg, shard.population, world_size))
def build_model(cfg: DictConfig) -> tuple[nn.Module, list[str]]:
    """The model as the job trains it: the ``model`` node, then its adapters (``peft``), then ``privacy.fix_model``'s
    fixes; and the notes of what was fixed. Untouched by training: no clipping hooks, no per-example state (run.py
    publishes the trained weights in such a copy)."""
    model = _instantiate(overrides.own_arguments(cfg, "model"), "model")
    if not isinstance(model, nn.Module):
        raise WorkbenchError(f"model._target_ built a {type(model).__name__}, not a torch.nn.Module")
    if cfg.get("peft"):  # adapters (LoRA): only they train, so only they are clipped and noised (none: {} too)
        model = _instantiate(cfg.peft, "peft", _partial_=True)(model)
    return prepare_model(model, cfg.privacy.enabled, cfg.privacy.fix_model)


def _takes_noise_std(make_optimizer: Any) -> bool:
    """Whether the optimizer takes the run's noise std (``noise_std``: DP-AdamBC, workbench/optim.py)."""
    try:
        return "noise_std" in inspect.signature(make_optimizer).parameters
    except (TypeError, ValueError):
        return False


def _autocast_dtype(cfg: DictConfig, device_type: str) -> torch.dtype | None:
    if cfg.fp16 and device_type != "cuda":
        raise WorkbenchError(f"fp16=true needs CUDA (this job runs on {device_type}); use bf16=true")
    return torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else None


def refuse_unsupported(cfg: DictConfig, runs_here: bool = True) -> None:
    """Refuse, in one line, what the config alone decides no run supports: a mechanism's unsupported settings or
    accountant (privacy/mechanism.py's check_settings), an optimizer that corrects for independent noise where there is
    none, a backend or precision this machine lacks (when the job runs on it), ew in mixed precision. The one place for
    these refusals: asked by the CLI before Hydra's app makes a folder, by launch and by train, before any data is
    read; from the config alone, so alike on every rank. What needs the data (b B / N, a batch larger than the data)
    is refused by build as soon as the shard is known. ``runs_here``: False where the job will run on another machine
    (a SLURM node, Hydra's submitit_slurm launcher), whose backend and device this one cannot ask."""
    p = cfg.privacy
    mechanism.check_settings(cfg, planned_world_size(cfg))
    if runs_here and cfg.launcher.name != "slurm":  # the job runs on this machine: its backend and device are known
        _autocast_dtype(cfg, distributed.device_type(distributed.resolve_backend(cfg.ddp_backend)))
    if p.enabled and p.grad_sample_mode == "ew" and (cfg.bf16 or cfg.fp16):  # auto's own pick: the step refuses it
        raise WorkbenchError(EW_MIXED_PRECISION)
    node = overrides.own_arguments(cfg, "optimizer")
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    try:
        make_optimizer = _locate(target) if isinstance(target, str) else None
    except Exception as e:  # noqa: BLE001 - Hydra's error names the missing module or attribute
        raise WorkbenchError(f"could not build optimizer: {' '.join(str(e).split())[:500]}") from None
    if make_optimizer is None or not _takes_noise_std(make_optimizer):
        return
    if "noise_std" in node:
        raise WorkbenchError("optimizer.noise_std is set from the run's mechanism (sigma C / B); remove it from the config")
    if not p.enabled:
        raise WorkbenchError(f"optimizer {target} corrects for the DP noise and needs privacy; use privacy=dp, or "
                             "optimizer=sgd (or torch.optim.AdamW) for a non-private run")
    kind, _ = mechanism.mechanism_kind(p, cfg.ddp_shard)
    if not mechanism.MECHANISMS[kind].independent_noise:  # its std is not sigma C / B: (C^-1 C^-T)_tt varies with t
        raise WorkbenchError(f"optimizer {target} corrects for independent noise of std sigma C / B; "
                             f"privacy.mechanism={kind}'s noise is correlated: use optimizer=sgd or torch.optim.AdamW")


def build(cfg: DictConfig, d: distributed.Dist, compute_metrics: Callable | None, extra_callbacks: list) -> Job:
    """Build this rank's job from `cfg`; everything that can be refused is refused here, alike on every rank."""
    torch.manual_seed(cfg.seed)
    autocast_dtype = _autocast_dtype(cfg, d.device.type)
    user_train_set, train_set, canaries = training_sets(cfg)
    user_train_set, index = user_index(cfg, user_train_set, canaries)  # unit=user: with the audit's canary users
    train_set = canaries.dataset if canaries else user_train_set
    user_callbacks = [*(_instantiate(c, "callbacks") for c in cfg.callbacks), *extra_callbacks]
    callbacks_.check(user_callbacks)
    eval_set = _instantiate(overrides.own_arguments(cfg, "data.eval"), "data.eval") if cfg.data.get("eval") is not None else None
    collator = _instantiate(overrides.own_arguments(cfg, "data.collator"), "data.collator") \
        if cfg.data.get("collator") is not None else None
    n = loaders.check_dataset(train_set, "training")
    if eval_set is not None:
        loaders.check_dataset(eval_set, "eval")
    if index is None:
        shard = sampling.train_shard(n, d.rank, d.world_size, cfg.ddp_shard, cfg.per_device_train_batch_size)
    else:
        shard = users.user_shard(index, d.rank, d.world_size, cfg.ddp_shard, cfg.per_device_train_batch_size)
    if cfg.privacy.enabled:  # the mechanism's recut (b B / N <= 1): refused before any line, model or data check
        mechanism.recut(cfg.privacy, shard, cfg.ddp_shard, d.world_size)
    if index is not None and d.is_main:  # the data check's line (console only: read from the raw data)
        print(index.describe(), flush=True)
    if shard.dropped:
        what = "users" if index is not None else "training examples"
        warnings.warn(f"ddp_shard=per_rank drops {shard.dropped} of {len(index) if index is not None else n} {what} "
                      f"so that {d.world_size} ranks get equal shards ({shard.population} used)", stacklevel=1)
    total_steps = planned_steps(cfg, shard.population, d.world_size)

    model, fixed = build_model(cfg)
    if d.is_main:
        for note in fixed:
            print(f"privacy.fix_model: {note}", flush=True)
    model.to(d.device)
    if d.distributed:  # identical start on every rank whatever the model's own RNG use
        for t in model.state_dict().values():
            torch.distributed.broadcast(t, 0)
    criterion = _instantiate(cfg.criterion, "criterion", reduction="none")
    make_optimizer = _instantiate(overrides.own_arguments(cfg, "optimizer"), "optimizer")
    wants_noise = _takes_noise_std(make_optimizer)  # with privacy and dpsgd only (refuse_unsupported)
    metrics_fn = compute_metrics or _compute_metrics(cfg.compute_metrics)
    for split, dataset in (("train", user_train_set), ("eval", eval_set)):  # the user's data, before any canaries
        if dataset is not None:
            check_fit(dataset, f"data.{split} ({cfg.data[split].get('_target_', 'no _target_')})", model, criterion,
                      d.device, collator)

    p = cfg.privacy
    plan = mechanism.plan(p, shard, cfg.ddp_shard, d.world_size, total_steps) if index is None else \
        users.plan_users(p, index, shard, cfg.ddp_shard, d.world_size, total_steps)
    for message in plan.notes:
        warnings.warn(message, stacklevel=1)

    # The canaries' gradient norm: the step's C (adaptive clipping: C_t, read as the step runs)
    canary_clip = (lambda: plan.clipping.value) if plan.private else (lambda: p.max_grad_norm)
    trained, trained_criterion = canaries.wrap(model, criterion, canary_clip) if canaries else (model, criterion)
    step_class = GradientStep if index is None else UserGradientStep  # unit=user: users' mean gradients clipped
    step_fn = step_class(trained, trained_criterion, d, max_grad_norm=plan.max_grad_norm,
                           noise_multiplier=plan.gradient_noise_multiplier, grad_sample_mode=p.grad_sample_mode,
                           max_physical_batch_size=cfg.max_physical_batch_size, autocast_dtype=autocast_dtype,
                           loss_scale=cfg.fp16_loss_scale if cfg.fp16 else None, clip_schedule=plan.clipping,
                           noise=plan.noise, expected_batch=cfg.per_device_train_batch_size,
                           physical_batch_memory=cfg.physical_batch_memory)
    # The same examples on every rank: a refusal is raised everywhere alike, before any run exists.
    first = loaders.first_examples(train_set, CHECK_EXAMPLES, collator)
    step_fn.check(first)
    if d.is_main and step_fn.mode_note:  # which mode auto picked, and why faster ones were skipped
        print(step_fn.mode_note, flush=True)
    step_fn.size_micro_batches(first)  # max_physical_batch_size=auto on CPU: from the memory budget
    if step_fn.auto:  # ranks may differ in free memory: every rank takes the smallest size (one margin everywhere)
        step_fn.max_physical_batch_size = step_fn.bound_batch = step_fn.clipper.max_batch = \
            min(d.all_gather_object(step_fn.max_physical_batch_size)) if d.distributed else step_fn.max_physical_batch_size
        if d.is_main:
            print(f"max_physical_batch_size=auto: {step_fn.max_physical_batch_size} examples per micro-batch", flush=True)
    # An optimizer that corrects for the noise (workbench/optim.py) is told its std per coordinate: sigma C / B.
    noise = {"noise_std": plan.noise_multiplier * plan.max_grad_norm / plan.expected_batch} if wants_noise else {}
    optimizer = make_optimizer(step_fn.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, **noise)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.lr_scheduler_type, cfg.warmup_steps,
                                                                       plan.steps))

    digest = config.privacy_digest(cfg, d.world_size)
    start_step, resume_run_id = 0, None
    # Rank 0's secret for everyone: the sampling and noise streams must be unknowable from the logged config.
    secret = d.broadcast_object(p.secure_seed if p.secure_seed is not None else secrets.randbits(63))
    if cfg.resume_from_checkpoint:
        path, state = checkpoint.load_resumable(cfg.resume_from_checkpoint, cfg.output_dir)
        if path is not None:
            if state.get("secret") is None:
                raise WorkbenchError(f"checkpoint {str(path)!r} has no stream secret (a published copy?); "
                                     "resume from the run folder's own checkpoint")
            if state.get("sampler") != sampling.SAMPLER:  # same config, other batches: not the run it continues
                raise WorkbenchError(f"checkpoint {str(path)!r} was written by the batch sampler "
                                     f"{state.get('sampler') or 'of a float32 uniform per example (before issue 44)'}, "
                                     f"not this version's {sampling.SAMPLER}; refusing to resume (start a new run)")
            if state.get("privacy_digest") != digest:
                raise WorkbenchError(f"checkpoint {str(path)!r} was written under a different privacy config "
                                     "(batch, steps, seed, shard, world size, noise, clipping or data differ); refusing to resume")
            hf.load_model_state(model, state["model"])
            optimizer.load_state_dict(canaries.with_canaries(state["optimizer"], state.get("audit"))
                                      if canaries else state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            if plan.private:
                plan.accountant.load_state_dict(state["accountant"])
            if plan.adaptive:  # C_t where the checkpoint left it (the digest has the schedule's settings)
                plan.clipping.load_state_dict(state.get("clipping"))
            if plan.strategy is not None:  # bandmf: the secret ring of past noise, where the checkpoint left it
                step_fn.noise.load_state_dict(state.get("correlated_noise"), int(state["step"]))
            if step_fn.auto and state.get("physical_batch_size"):  # the size and margins the run had: bit-exact
                size, bound = state["physical_batch_size"]
                step_fn.max_physical_batch_size, step_fn.bound_batch = int(size), int(bound)
                step_fn.clipper.max_batch = int(bound)
            start_step, resume_run_id = int(state["step"]), state.get("run_id")
            secret = state["secret"]
            log.info("resuming from %s at step %d", path, start_step)

    step_fn.noise_seed = sampling.stream_seed(secret, cfg.seed)  # known only now: a resumed run takes the checkpoint's
    sampler = plan.sampler(sampling.stream_seed(secret, cfg.data_seed if cfg.data_seed is not None else cfg.seed),
                           d.rank, start_step)
    named = [(name, prm) for name, prm in model.named_parameters() if prm.requires_grad]
    if canaries:
        coefficients = step_fn.noise.c if plan.kind == "bandmf" else None  # the noise's own (a resume's); blt: none
        user_callbacks.append(canaries.start(secret, cfg.seed, canary_clip, plan, coefficients))
        if start_step:  # where the checkpoint left the audit (the run folder's private state)
            canaries.load_state_dict(state.get("audit"), start_step)
        named = canaries.named_parameters(model)
    eval_loader = None
    if eval_set is not None:
        eval_loader = loaders.eval_loader(eval_set, loaders.eval_shard(len(eval_set), d.rank, d.world_size), cfg,
                                          d.device, collator)
    loader = loaders.train_loader(train_set, sampler, cfg, d.device, collator)
    return Job(model=model, criterion=criterion, mechanism=plan, step_fn=step_fn, optimizer=optimizer,
               scheduler=scheduler, loader=loader if index is None else data_users.UserBatches(loader),
               eval_loader=eval_loader, metrics_fn=metrics_fn,
               callbacks=callbacks_.CallbackList(user_callbacks, model, named, plan.steps), collator=collator,
               autocast_dtype=autocast_dtype, secret=secret, digest=digest, start_step=start_step,
               resume_run_id=resume_run_id, canaries=canaries, fixed_modules=fixed)
