"""One training job, end to end: validate -> process group -> data, model, privacy -> MLflow run -> train -> eval ->
checkpoint -> summary. The CLI, the launchers and the notebook API all call :func:`train`."""

from __future__ import annotations

import gc
import json
import logging
import math
import secrets
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from workbench import cache, checkpoint, config, data, data_checks, distributed, hf, privacy
from workbench import callbacks as callbacks_
from workbench.errors import TrainingStopped, WorkbenchError
from workbench.interrupt import Interrupted, ignore_further, signals_interrupt
from workbench.models import prepare_model
from workbench.tracking.runs import git_sha
from workbench.tracking.tracker import end_if_abandoned, make_tracker
from workbench.tracking.uris import ui_command
from workbench.trainer import CHECK_EXAMPLES, Evaluator, GradientStep, History, Trainer, lr_lambda
from workbench.world_size import planned_world_size

if TYPE_CHECKING:  # audit=canaries only: scipy.stats is most of a second to import
    from workbench.audit_bound import AuditResult

log = logging.getLogger("workbench")

# Checkpoint entries that stay in the run folder and never reach MLflow (see _fit).
PRIVATE_STATE = ("secret", "privacy_digest")


@dataclass
class TrainResult:
    """What a finished job hands back (on every rank; only rank 0 has a run in MLflow)."""

    metrics: dict[str, float]
    epsilon: float | None
    delta: float | None
    noise_multiplier: float | None
    sample_rate: float
    steps: int
    run_id: str | None
    tracking_uri: str | None
    output_dir: Path
    checkpoint: Path | None
    model: nn.Module = field(repr=False)
    history: History = field(repr=False)
    audit: AuditResult | None = None  # audit=canaries: the lower bound on epsilon and how it was found


def closing_line(metrics: dict[str, float], epsilon: float | None, delta: float | None, steps: int,
                 run_id: str | None, uri: str | None, job_id: str | None = None, audit: AuditResult | None = None) -> str:
    """The one line every launcher (inline, local, SLURM) ends a job with."""
    parts = [f"{k}={v:.4f}" for k, v in metrics.items()]
    if epsilon is not None:
        parts.append(f"epsilon={epsilon:.3f} at delta={delta:.1e}")
    if audit is not None:
        parts.append(f"audit: epsilon>={audit.epsilon_lower_bound:.3f} (ideal {audit.ideal_lower_bound:.3f})")
    parts.append(f"steps={steps}")
    if job_id is not None:
        parts.append(f"job_id={job_id}")
    if run_id:
        parts.append(f"run_id={run_id} | {ui_command(uri)}")
    return "done: " + " ".join(parts)


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


def _quiet_unless(should_log: bool) -> None:
    """Ranks that do not log (all but rank 0, or each node's local rank 0 with log_on_each_node) stay quiet: a
    warning every rank hits alike is printed once per job (once per node), not once per rank."""
    if not should_log:
        logging.getLogger().setLevel(logging.WARNING)
        logging.getLogger("workbench").setLevel(logging.WARNING)
        warnings.simplefilter("ignore")


def train(cfg: DictConfig, compute_metrics: Callable | None = None, callbacks: list | None = None,
          on_end: Callable[[DictConfig], None] | None = None) -> TrainResult:
    """Run one job in this process (joining the job's process group when there is one). ``callbacks``: objects with
    ``on_step_end(state)`` and friends (workbench/callbacks.py), after those in ``cfg.callbacks``. ``on_end(cfg)``:
    called once the job has ended, however it ended, where it made an MLflow run (rank 0); what launches the job
    passes it (a sweep's point summarises its sweep, workbench/sweep.py), so the job never imports the layers above."""
    config.validate(cfg)
    with signals_interrupt():
        return _train(cfg, compute_metrics, callbacks, on_end)


def _train(cfg: DictConfig, compute_metrics: Callable | None, callbacks: list | None,
           on_end: Callable[[DictConfig], None] | None) -> TrainResult:
    d = distributed.setup(cfg.ddp_backend, cfg.ddp_timeout, cfg.log_on_each_node, cfg.save_on_each_node)
    tracker = None
    run_id = None
    try:
        _quiet_unless(d.should_log)
        tracker = make_tracker(cfg, d.is_main)
        _refuse_everywhere(d, tracker.check)
        cfg.output_dir = d.broadcast_object(str(config.resolve_output_dir(cfg)))  # one run folder for every rank
        output_dir = Path(cfg.output_dir)
        config.check_writable(output_dir)
        _refuse_everywhere(d, lambda: checkpoint.check_folder(output_dir, cfg.resume_from_checkpoint))
        job = _build(cfg, d, compute_metrics, callbacks or [])
        tags = {"backend": d.backend, "ddp_shard": cfg.ddp_shard, "world_size": d.world_size, "git_sha": git_sha(),
                "launcher": cfg.launcher.name, "private": cfg.privacy.enabled, **cfg.tracking.tags}
        if job["fixed_modules"]:
            tags["fixed_modules"] = "; ".join(job["fixed_modules"])
        tracker.start({**tags, "status": "running"}, run_id=job["resume_run_id"] or cfg.tracking.run_id,
                      sweep_dir=cfg.tracking.sweep_dir)
        if job["accountant"] is not None:  # what a sweep composes, known even if the run fails before its summary
            tracker.set_tags({"workbench.dp_event": json.dumps(dp_event_fields(job["accountant"], job["total_steps"],
                                                                               job["delta"]))})
        run_id = d.broadcast_object(tracker.run_id)
        _settle_heap()
        result = _fit(cfg, d, job, tracker, run_id, output_dir)
        d.barrier()  # ranks leave together: one tearing its gloo connections down under a busy peer can abort
        return result
    except BaseException as e:
        ignore_further()
        if tracker is not None:
            tracker.settle()
        status = "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED"
        if isinstance(e, Interrupted):
            e.output_dir = cfg.output_dir
        if d.is_main and tracker is not None and tracker.run_id:
            tracker.set_tags({"error": (" ".join(f"{type(e).__name__}: {e}".split()))[:500]})
            tracker.finish(status)
        elif run_id and cfg.tracking.enabled:  # rank 0 may be dead (SIGKILL): a survivor ends the run it left RUNNING
            end_if_abandoned(cfg, run_id, status)
        raise
    finally:
        distributed.teardown(d)
        if tracker is not None and tracker.run_id and on_end is not None:
            _job_ended(on_end, cfg)


def training_sets(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """The user's training set, the one trained on (with the audit's canary slots, which join the population: N and q
    count them whatever their membership) and the audit (or None)."""
    train_set = _instantiate(config.own_arguments(cfg, "data.train"), "data.train")
    if not cfg.audit.enabled:
        return train_set, train_set, None
    if cfg.resume_from_checkpoint:
        raise WorkbenchError("audit=canaries cannot resume a run yet (its observers start at step 0)")
    from workbench.canaries import CanaryAudit

    canaries = CanaryAudit(cfg.audit.canaries, train_set, cfg.audit.significance)
    return train_set, canaries.dataset, canaries


def planned_steps(cfg: DictConfig, population: int, world_size: int) -> int:
    expected_batch = cfg.per_device_train_batch_size * world_size
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * population / expected_batch)
    if total_steps > config.STEPS_MAX:
        raise WorkbenchError(f"num_train_epochs={cfg.num_train_epochs} makes {total_steps} steps, more than "
                             f"{config.STEPS_MAX}; lower it or set max_steps")
    return total_steps


def privacy_plan(cfg: DictConfig, shard: data.Shard, world_size: int, total_steps: int):
    """(accountant, delta, sigma, steps, warnings) of a run: the one place that turns a config into its DP mechanism,
    for the run itself and for a sweep that bounds its candidates before any trains (workbench/sweep.py). Without
    privacy: (None, None, 0.0, total_steps, [])."""
    p = cfg.privacy
    if not p.enabled:
        return None, None, 0.0, total_steps, []
    delta = p.target_delta if p.target_delta is not None else privacy.default_delta(shard.population)
    notes = privacy.validate_privacy_args(p.target_epsilon, delta, p.noise_multiplier, p.max_grad_norm,
                                         shard.population)
    if p.noise_multiplier == 0:
        raise WorkbenchError("privacy.noise_multiplier=0 gives no privacy; use privacy.enabled=false for a non-private run")
    sigma = p.noise_multiplier if p.noise_multiplier is not None else cache.cached(
        "calibrate_noise", lambda: privacy.calibrate_noise(p.accountant, shard.sample_rate, total_steps,
                                                           p.target_epsilon, delta, world_size, cfg.ddp_shard),
        kind=p.accountant, sample_rate=shard.sample_rate, steps=total_steps, target_epsilon=p.target_epsilon,
        delta=delta, world_size=world_size, shard=cfg.ddp_shard, code=privacy.code_version())
    accountant = privacy.Accountant(p.accountant, shard.sample_rate, sigma, world_size, cfg.ddp_shard)
    if p.target_epsilon is not None:
        budget = cache.cached("max_steps", lambda: accountant.max_steps(p.target_epsilon, delta, total_steps),
                              accountant=accountant.state_dict(), target_epsilon=p.target_epsilon, delta=delta,
                              upper=total_steps, code=privacy.code_version())
        if budget == 0:
            raise WorkbenchError(f"privacy.target_epsilon={p.target_epsilon} is exceeded by the first step at "
                                 f"noise_multiplier={sigma}; raise the noise or the target")
        if budget < total_steps:
            notes.append(f"the run stops after {budget} of {total_steps} steps: one more would exceed "
                         f"target_epsilon={p.target_epsilon}")
            total_steps = budget
    return accountant, delta, sigma, total_steps, notes


def planned_mechanism(cfg: DictConfig) -> dict[str, Any]:
    """What a run of `cfg` would spend, from its config alone (the training set is built for its size, nothing
    trains): the fields of its ``workbench.dp_event`` tag, or ``{"private": False}``. The world size is the one its
    launcher asks for. Raises WorkbenchError when the run would be refused."""
    world_size = planned_world_size(cfg)
    _, train_set, _ = training_sets(cfg)
    shard = data.train_shard(data.check_dataset(train_set, "training"), 0, world_size, cfg.ddp_shard,
                             cfg.per_device_train_batch_size)
    accountant, delta, _, steps, _ = privacy_plan(cfg, shard, world_size, planned_steps(cfg, shard.population, world_size))
    if accountant is None:
        return {"private": False}
    return dp_event_fields(accountant, steps, delta)


def dp_event_fields(accountant: privacy.Accountant, steps: int, delta: float) -> dict[str, Any]:
    """A run's mechanism as its ``workbench.dp_event`` tag records it (read back by workbench/sweep.py)."""
    a = accountant
    return dict(sample_rate=a.sample_rate, noise_multiplier=a.noise_multiplier, world_size=a.world_size, shard=a.shard,
                planned_steps=steps, delta=delta)


def _settle_heap() -> None:
    """The CLI turns garbage collection off while it starts (workbench/__main__.py): imports and the build make
    hundreds of thousands of objects that live as long as the process, and collecting them again and again costs
    about half a second. Training is about to begin: those objects move to the permanent generation, out of every later
    collection, and collection resumes. A process that never turned it off (a notebook) is left as it is."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _refuse_everywhere(d: distributed.Dist, check: Callable[[], str | None]) -> None:
    """Run a check on rank 0 (a message, None, or a WorkbenchError) and raise its refusal on every rank alike."""
    problem = None
    if d.is_main:
        try:
            problem = check()
        except WorkbenchError as e:
            problem = str(e)
    problem = d.broadcast_object(problem)
    if problem:
        raise WorkbenchError(problem)


def _job_ended(on_end: Callable[[DictConfig], None], cfg: DictConfig) -> None:
    """The launcher's job-end hook; never fails the run (its outcome is already decided)."""
    try:
        on_end(cfg)
    except Exception as e:  # noqa: BLE001
        log.warning("the job-end hook %s failed: %s", getattr(on_end, "__name__", on_end), e)


def _autocast_dtype(cfg: DictConfig, device: torch.device) -> torch.dtype | None:
    if cfg.fp16 and device.type != "cuda":
        raise WorkbenchError(f"fp16=true needs CUDA (this job runs on {device.type}); use bf16=true")
    return torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else None


def _build(cfg: DictConfig, d: distributed.Dist, compute_metrics: Callable | None, extra_callbacks: list) -> dict[str, Any]:
    """Everything that can be refused is built here, before an MLflow run exists."""
    torch.manual_seed(cfg.seed)
    autocast_dtype = _autocast_dtype(cfg, d.device)
    user_train_set, train_set, canaries = training_sets(cfg)
    user_callbacks = [*(_instantiate(c, "callbacks") for c in cfg.callbacks), *extra_callbacks]
    callbacks_.check(user_callbacks)
    eval_set = _instantiate(config.own_arguments(cfg, "data.eval"), "data.eval") if cfg.data.get("eval") is not None else None
    collator = _instantiate(config.own_arguments(cfg, "data.collator"), "data.collator") \
        if cfg.data.get("collator") is not None else None
    n = data.check_dataset(train_set, "training")
    if eval_set is not None:
        data.check_dataset(eval_set, "eval")
    shard = data.train_shard(n, d.rank, d.world_size, cfg.ddp_shard, cfg.per_device_train_batch_size)
    if shard.dropped:
        warnings.warn(f"ddp_shard=per_rank drops {shard.dropped} of {n} training examples so that "
                      f"{d.world_size} ranks get equal shards ({shard.population} used)", stacklevel=1)
    expected_batch = cfg.per_device_train_batch_size * d.world_size
    total_steps = planned_steps(cfg, shard.population, d.world_size)

    model = _instantiate(config.own_arguments(cfg, "model"), "model")
    if not isinstance(model, nn.Module):
        raise WorkbenchError(f"model._target_ built a {type(model).__name__}, not a torch.nn.Module")
    if cfg.get("peft") is not None:  # adapters (LoRA): only they train, so only they are clipped and noised
        model = _instantiate(cfg.peft, "peft", _partial_=True)(model)
    model, fixed = prepare_model(model, cfg.privacy.enabled, cfg.privacy.fix_model)
    if d.is_main:
        for note in fixed:
            print(f"privacy.fix_model: {note}", flush=True)
    model.to(d.device)
    if d.distributed:  # identical start on every rank whatever the model's own RNG use
        for t in model.state_dict().values():
            torch.distributed.broadcast(t, 0)
    criterion = _instantiate(cfg.criterion, "criterion", reduction="none")
    make_optimizer = _instantiate(cfg.optimizer, "optimizer")  # refused here, before the seconds of noise calibration
    metrics_fn = compute_metrics or _compute_metrics(cfg.compute_metrics)
    for split, dataset in (("train", user_train_set), ("eval", eval_set)):  # the user's data, before any canaries
        if dataset is not None:
            data_checks.check_fit(dataset, f"data.{split} ({cfg.data[split].get('_target_', 'no _target_')})", model,
                                  criterion, d.device, collator)

    p = cfg.privacy
    accountant, delta, sigma, total_steps, notes = privacy_plan(cfg, shard, d.world_size, total_steps)
    for message in notes:
        warnings.warn(message, stacklevel=1)

    trained, trained_criterion = canaries.wrap(model, criterion, p.max_grad_norm) if canaries else (model, criterion)
    step_fn = GradientStep(trained, trained_criterion, d, max_grad_norm=p.max_grad_norm if p.enabled else None,
                           noise_multiplier=sigma, grad_sample_mode=p.grad_sample_mode,
                           max_physical_batch_size=cfg.max_physical_batch_size, autocast_dtype=autocast_dtype,
                           loss_scale=cfg.fp16_loss_scale if cfg.fp16 else None)
    # The same examples on every rank: a refusal is raised everywhere alike, before any run exists.
    step_fn.check(data.first_examples(train_set, CHECK_EXAMPLES, collator))
    optimizer = make_optimizer(step_fn.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.lr_scheduler_type, cfg.warmup_steps, total_steps))

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
            if state.get("privacy_digest") != digest:
                raise WorkbenchError(f"checkpoint {str(path)!r} was written under a different privacy config "
                                     "(batch, steps, seed, shard, world size, noise, clipping or data differ); refusing to resume")
            hf.load_model_state(model, state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            if accountant is not None:
                accountant.load_state_dict(state["accountant"])
            start_step, resume_run_id = int(state["step"]), state.get("run_id")
            secret = state["secret"]
            log.info("resuming from %s at step %d", path, start_step)

    step_fn.noise_seed = data.stream_seed(secret, cfg.seed)  # known only now: a resumed run takes the checkpoint's
    sampler = data.PoissonBatchSampler(shard, total_steps, data.stream_seed(secret, cfg.data_seed if cfg.data_seed is not None
                                                                            else cfg.seed), d.rank, start_step)
    named = [(name, prm) for name, prm in model.named_parameters() if prm.requires_grad]
    if canaries:
        user_callbacks.append(canaries.start(secret, cfg.seed, p.max_grad_norm, expected_batch, sigma, shard.sample_rate,
                                             d.world_size, cfg.ddp_shard))
        named = canaries.named_parameters(model)
    job_callbacks = callbacks_.CallbackList(user_callbacks, model, named, total_steps)
    eval_loader = None
    if eval_set is not None:
        eval_loader = data.eval_loader(eval_set, data.eval_shard(len(eval_set), d.rank, d.world_size), cfg, d.device,
                                       collator)
    return dict(model=model, criterion=criterion, shard=shard, step_fn=step_fn, optimizer=optimizer,
                scheduler=scheduler, accountant=accountant, secret=secret, delta=delta, sigma=sigma, total_steps=total_steps,
                expected_batch=expected_batch, start_step=start_step, resume_run_id=resume_run_id, digest=digest,
                loader=data.train_loader(train_set, sampler, cfg, d.device, collator), eval_loader=eval_loader,
                metrics_fn=metrics_fn, canaries=canaries, callbacks=job_callbacks, fixed_modules=fixed, collator=collator,
                autocast_dtype=autocast_dtype)


def _blame_data(cfg: DictConfig, d: distributed.Dist, job: dict, step: int, error: Exception) -> None:
    """A step that raised (not one that went non-finite): data that turned bad past the examples the pre-run check
    read (a label out of range, another width, a record that cannot be read). Raise one line naming the dataset index
    when one example of the step's batch fails alone; return when none does (the error is not the data's)."""
    loader = job["loader"]
    name = f"data.train ({cfg.data.train.get('_target_', 'no _target_')})"
    try:
        blamed = data_checks.blame_example(loader.dataset, loader.batch_sampler.indices_for_step(step), name,
                                           job["model"], job["criterion"], d.device, job["collator"])
    except Exception:  # noqa: BLE001 - the search itself failed: the step's own error stands
        return
    if blamed is not None:
        raise TrainingStopped(f"training stopped at step {step + 1}: {blamed}; checkpoints of earlier steps are kept") \
            from error


def _fit(cfg: DictConfig, d: distributed.Dist, job: dict, tracker, run_id: str | None, output_dir: Path) -> TrainResult:
    model, accountant, delta, canaries = job["model"], job["accountant"], job["delta"], job["canaries"]
    last_saved: list[Path | None] = [None]

    def state(step: int) -> dict:
        optimizer = job["optimizer"].state_dict()
        return {"model": hf.model_state(model), "optimizer": canaries.without_canaries(optimizer) if canaries else optimizer,
                "scheduler": job["scheduler"].state_dict(), "step": step, "run_id": run_id,
                "privacy_digest": job["digest"], "world_size": d.world_size, "secret": job["secret"],
                "accountant": accountant.state_dict() if accountant is not None else None}

    def save(step: int) -> None:
        snapshot = state(step)
        with d.collective_phase(f"checkpoint save at step {step}"):
            if d.should_save:
                last_saved[0] = checkpoint.save(snapshot, output_dir, step, cfg.save_total_limit)

    evaluator = None
    if job["eval_loader"] is not None:
        evaluator = Evaluator(model, job["criterion"], job["eval_loader"], d, job["metrics_fn"],
                              cfg.eval_use_gather_object, cfg.batch_eval_metrics, job["autocast_dtype"])
    trainer = Trainer(cfg, d, model, job["step_fn"], job["optimizer"], job["scheduler"], job["loader"],
                      evaluator or (lambda: {}), accountant, delta, tracker, job["expected_batch"],
                      job["shard"].population, job["total_steps"], job["start_step"], save, job["callbacks"])
    try:
        steps = trainer.fit()
    except Exception as e:
        if isinstance(e, WorkbenchError) or trainer.failed_step is None:
            raise
        _blame_data(cfg, d, job, trainer.failed_step, e)
        raise
    metrics = evaluator() if evaluator is not None else {}
    summary = {"steps": steps, "sample_rate": job["shard"].sample_rate, "world_size": d.world_size}
    epsilon = None
    if accountant is not None:
        epsilon = accountant.epsilon(steps, delta, on_disk=True)  # the schedule's last value, read back on a rerun
        summary.update(epsilon=epsilon, delta=delta, noise_multiplier=job["sigma"])
    found = None
    if canaries:
        found = canaries.result(epsilon, delta or privacy.default_delta(job["shard"].population), job["sigma"],
                                job["shard"].sample_rate, steps, d.world_size, cfg.ddp_shard)
        summary.update(found.metrics())
    final = {**metrics, **summary}
    if trainer.history.steps and trainer.history.steps[-1] == steps:
        final.pop("epsilon", None)  # already logged at this step by the loop: log each (metric, step) once
    tracker.log_metrics(final, steps)
    save(steps)
    if d.is_main:
        if cfg.tracking.log_checkpoints and last_saved[0] is not None:
            # The published copy leaves out the stream secret, and the privacy digest: it hashes the config with a
            # pinned secure_seed, so the public config would let a small seed be brute-forced from it.
            with tempfile.TemporaryDirectory() as tmp:
                published = Path(tmp) / last_saved[0].name
                torch.save({k: v for k, v in state(steps).items() if k not in PRIVATE_STATE}, published)
                tracker.log_artifact(published, "checkpoints")
        if hf.is_adapter(model):  # the adapter in peft's own format: PeftModel.from_pretrained(base, folder)
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp)
                for f in sorted(Path(tmp).iterdir()):
                    tracker.log_artifact(f, "adapter")
        if trainer.history.steps:  # drawn where it is sent (the tracking worker): matplotlib stays out of this process
            tracker.log_curves(trainer.history)
    tracker.finish("FINISHED")
    uri = tracker.uri if run_id else None
    if d.is_main:
        line = closing_line(metrics, epsilon, delta, steps, run_id, uri, audit=found)
        if tracker.spooled:
            line += (f" | tracking server unreachable: spooled to {tracker.spooled}, upload with "
                     f"python -m workbench.tracking sync {output_dir}")
        print(line, flush=True)
    return TrainResult(metrics=metrics, epsilon=epsilon, delta=delta, noise_multiplier=job["sigma"] if accountant else None,
                       sample_rate=job["shard"].sample_rate, steps=steps, run_id=run_id, tracking_uri=uri,
                       output_dir=output_dir, checkpoint=last_saved[0], model=model, history=trainer.history,
                       audit=found)
