"""One training job, end to end: validate -> process group -> data, model, privacy -> MLflow run -> train -> eval ->
checkpoint -> summary. The CLI, the launchers and the notebook API all call :func:`train`."""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import secrets
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from workbench import checkpoint, config, distributed, privacy
from workbench.data.checks import blame_example
from workbench.errors import TrainingStopped, WorkbenchError
from workbench.evaluation import Evaluator
from workbench.interrupt import Interrupted, ignore_further, join, signals_interrupt
from workbench.job import Job, build, build_model, refuse_unsupported
from workbench.models import hf
from workbench.privacy import sampling
from workbench.privacy.accounting.tradeoff import membership_bounds
from workbench.tracking.runs import NOTE_TAG, git_sha, source_tags
from workbench.tracking.tracker import end_if_abandoned, make_tracker
from workbench.tracking.uris import ui_command
from workbench.trainer import History, LoopConfig, Trainer

if TYPE_CHECKING:  # audit=canaries only: scipy.stats is most of a second to import
    from workbench.privacy.auditing.bound import AuditResult

log = logging.getLogger("workbench")

# Checkpoint entries that stay in the run folder and never reach MLflow (see _fit).
# bandmf's ring: past noise, as secret as the secret; audit: the canaries' scores and their observer's past updates
PRIVATE_STATE = ("secret", "privacy_digest", "correlated_noise", "audit")
PRIVATE_STATE += ("physical_batch_size",)  # auto's size may have halved on a realised (private) batch size


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
                 run_id: str | None, uri: str | None, job_id: str | None = None, audit: AuditResult | None = None,
                 experiment_id: str | None = None, unit: str = "example") -> str:
    """The one line every launcher (inline, local, SLURM) ends a job with (``unit``: the unit of privacy)."""
    parts = [f"{k}={v:.4f}" for k, v in metrics.items()]
    if epsilon is not None:
        parts.append(f"epsilon={epsilon:.3f} at delta={delta:.1e}" + (" per user" if unit == "user" else ""))
    if audit is not None:
        parts.append(f"audit: epsilon>={audit.epsilon_lower_bound:.3f}" + (" per user" if audit.unit == "user" else "")
                     + (f" (ideal {audit.ideal_lower_bound:.3f})" if audit.ideal_lower_bound is not None else
                        f" ({audit.observer} observer alone)"))
    parts.append(f"steps={steps}")
    if job_id is not None:
        parts.append(f"job_id={job_id}")
    if run_id:
        parts.append(f"run_id={run_id}" + (f" | {ui_command(uri, experiment_id, run_id)}" if uri else ""))
    return "done: " + " ".join(parts)


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
    passes it (a sweep's point summarises its sweep, workbench/sweep/), so the job never imports the layers above."""
    config.validate(cfg)
    refuse_unsupported(cfg)
    with signals_interrupt():
        return _train(cfg, compute_metrics, callbacks, on_end)


def _train(cfg: DictConfig, compute_metrics: Callable | None, callbacks: list | None,
           on_end: Callable[[DictConfig], None] | None) -> TrainResult:
    d = distributed.setup(cfg.ddp_backend, cfg.ddp_timeout, cfg.log_on_each_node, cfg.save_on_each_node)
    peers = join(distributed.store() if d.distributed else None, d.world_size, d.rank,  # how the others learn why
                 d.broadcast_object(secrets.token_hex(8)) if d.distributed else "")  # we stop, this run's alone
    tracker = None
    run_id = None
    try:
        _quiet_unless(d.should_log)
        tracker = make_tracker(cfg, d.is_main)
        _refuse_everywhere(d, tracker.check)
        cfg.output_dir = d.broadcast_object(str(config.resolve_output_dir(cfg)))  # one run folder for every rank
        output_dir = Path(cfg.output_dir)
        config.check_writable(output_dir)
        d.check_node_folders(output_dir)  # save_on_each_node on several nodes: never one folder shared by them
        _refuse_everywhere(d, lambda: checkpoint.check_folder(output_dir, cfg.resume_from_checkpoint))
        job = build(cfg, d, compute_metrics, callbacks or [])
        sha = git_sha()
        tags = {"backend": d.backend, "ddp_shard": cfg.ddp_shard, "world_size": d.world_size, "git_sha": sha,
                "launcher": cfg.launcher.name, "private": cfg.privacy.enabled,
                **source_tags(cfg.launcher.name, sha), **cfg.tracking.tags}
        if job.mechanism.private:
            tags["grad_sample_mode"] = job.step_fn.mode  # what auto picked (its reason: the console's line)
            tags["privacy_unit"] = _unit(job.mechanism)  # what epsilon protects: one example, or one user
            tags["privacy_adjacency"] = job.mechanism.adjacency  # and against which neighbouring change (mechanism.py)
        if job.step_fn.auto:  # the size chosen before training (a later out-of-memory halving: console only)
            tags["physical_batch_size"] = job.step_fn.max_physical_batch_size
        if job.fixed_modules:
            tags["fixed_modules"] = "; ".join(job.fixed_modules)
        tracker.start({**tags, "status": "running"}, run_id=job.resume_run_id or cfg.tracking.run_id,
                      sweep_dir=cfg.tracking.sweep_dir)
        if job.mechanism.private:  # what a sweep composes, known even if the run fails before its summary
            tracker.set_tags({"workbench.dp_event": json.dumps(job.mechanism.event_fields())})
        tracker.log_system_metrics(cfg.tracking.system_metrics_interval)
        for info in _run_inputs(cfg, job):
            tracker.log_dataset(info)
        run_id = d.broadcast_object(tracker.run_id)
        _settle_heap()
        result = _fit(cfg, d, job, tracker, run_id, output_dir)
        d.barrier()  # ranks leave together: one tearing its gloo connections down under a busy peer can abort
        return result
    except BaseException as error:
        try:
            ignore_further()
        except Interrupted:  # a signal in the instant `error` began to be handled: the later cause (peers count it)
            ignore_further()
        if tracker is not None:
            tracker.settle()
        status = peers.outcome(error)  # the first cause: a peer that died first makes it FAILED (workbench/interrupt.py)
        if isinstance(error, WorkbenchError) and not isinstance(error, TrainingStopped):
            error.alike = peers.refused_alike(error)  # rank 0 refused the same: only it says so (__main__.refuse)
        e = peers.as_interrupted(error) if status == "KILLED" else error
        if isinstance(e, Interrupted):
            e.output_dir = cfg.output_dir
        if d.is_main and tracker is not None and tracker.run_id:
            why = " (a peer rank had failed, died or been stopped alone first)" if status == "FAILED" and \
                isinstance(e, KeyboardInterrupt) else ""
            tracker.set_tags({"error": (" ".join(f"{type(e).__name__}: {e}{why}".split()))[:500]})
            tracker.finish(status)
        elif run_id and cfg.tracking.enabled:  # rank 0 may be dead (SIGKILL): a survivor ends the run it left RUNNING
            end_if_abandoned(cfg, run_id, status)
        if e is error:
            raise
        raise e from error
    finally:
        distributed.teardown(d)
        if tracker is not None and tracker.run_id and on_end is not None:
            _job_ended(on_end, cfg)


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


def _blame_data(cfg: DictConfig, d: distributed.Dist, job: Job, step: int, error: Exception) -> None:
    """A step that raised (not one that went non-finite): data that turned bad past the examples the pre-run check
    read (a label out of range, another width, a record that cannot be read). Raise one line naming the dataset index
    when one example of the step's batch fails alone; return when none does (the error is not the data's)."""
    if job.canaries:  # its examples are tagged for the audited model, not the user's: the step's own error stands
        return
    loader = job.loader
    name = f"data.train ({cfg.data.train.get('_target_', 'no _target_')})"
    try:
        blamed = blame_example(loader.dataset, loader.batch_sampler.indices_for_step(step), name,
                               job.model, job.criterion, d.device, job.collator)
    except Exception:  # noqa: BLE001 - the search itself failed: the step's own error stands
        return
    if blamed is not None:
        raise TrainingStopped(f"training stopped at step {step + 1}: {blamed}; checkpoints of earlier steps are kept") \
            from error


def _fit(cfg: DictConfig, d: distributed.Dist, job: Job, tracker, run_id: str | None, output_dir: Path) -> TrainResult:
    model, plan, canaries = job.model, job.mechanism, job.canaries
    accountant, delta = plan.accountant, plan.delta
    last_saved: list[Path | None] = [None]

    def state(step: int) -> dict:
        optimizer = job.optimizer.state_dict()
        return {"model": hf.model_state(model), "optimizer": canaries.without_canaries(optimizer) if canaries else optimizer,
                "scheduler": job.scheduler.state_dict(), "step": step, "run_id": run_id,
                "privacy_digest": job.digest, "world_size": d.world_size, "secret": job.secret,
                "sampler": sampling.SAMPLER,
                "accountant": accountant.state_dict() if accountant is not None else None,
                "clipping": plan.clipping.state_dict() if plan.private else None,
                "physical_batch_size": [job.step_fn.max_physical_batch_size, job.step_fn.bound_batch],
                **({"correlated_noise": job.step_fn.noise.state_dict()} if plan.strategy is not None else {}),
                **({"audit": canaries.state_dict(optimizer)} if canaries else {})}

    def save(step: int) -> None:
        snapshot = state(step)
        with d.collective_phase(f"checkpoint save at step {step}"):
            if d.should_save:
                last_saved[0] = checkpoint.save(snapshot, output_dir, step, cfg.save_total_limit)

    def save_in_loop(step: int) -> None:  # a save_steps checkpoint; with tracking.log_model_checkpoints, its model too
        save(step)
        if d.is_main and cfg.tracking.log_model_checkpoints:
            eps = plan.epsilon(step) if plan.private else None
            _log_model(cfg, tracker, model, plan, eps, step, f"checkpoint-{step}")

    evaluator = None
    if job.eval_loader is not None:
        evaluator = Evaluator(model, job.criterion, job.eval_loader, d, job.metrics_fn, cfg.eval_use_gather_object,
                              cfg.batch_eval_metrics, job.autocast_dtype)
    trainer = Trainer(LoopConfig.of(cfg, job.start_step, d.should_log), d, plan, model, job.step_fn, job.optimizer,
                      job.scheduler, job.loader, evaluator or (lambda: {}), tracker, save_in_loop, job.callbacks)
    try:
        steps = trainer.fit()
    except Exception as e:
        if isinstance(e, WorkbenchError) or trainer.failed_step is None:
            raise
        _blame_data(cfg, d, job, trainer.failed_step, e)
        raise
    metrics = evaluator() if evaluator is not None else {}
    summary = {"steps": steps, "sample_rate": plan.sample_rate, "world_size": d.world_size}
    epsilon, bounds = None, None
    if plan.private:
        epsilon = plan.epsilon(steps)  # the schedule's last value, read back on a rerun
        summary.update(epsilon=epsilon, delta=delta, noise_multiplier=plan.noise_multiplier)
        if d.is_main:  # what that epsilon means: the most any membership-inference attack achieves (README)
            bounds = membership_bounds(accountant, steps)
            summary.update(bounds.metrics())
        if plan.adaptive:  # the C the run ended with, and the gradient's share of the noise
            summary.update(clip_norm=job.step_fn.clip_norm, gradient_noise_multiplier=plan.gradient_noise_multiplier)
    found = None
    if canaries:
        found = canaries.result(epsilon, delta or privacy.default_delta(plan.shard.population), plan, steps)
        summary.update(found.metrics())
    tracker.log_metrics({**metrics, **summary}, steps)  # epsilon and C the loop logged at this step go once (only_new)
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
            tracker.log_curves(trainer.history, unit=_unit(plan))  # the plot says what epsilon is of
        if bounds is not None:  # drawn by the tracking worker too (workbench.plots.privacy_tradeoff)
            tracker.log_plot("privacy_tradeoff", "privacy_tradeoff.png", {
                "fpr": list(bounds.fpr), "tpr": list(bounds.tpr), "epsilon": epsilon, "delta": delta,
                "advantage": bounds.advantage, **({"unit": "user"} if _unit(plan) == "user" else {})})
        if cfg.tracking.log_model:
            _log_model(cfg, tracker, model, plan, epsilon, steps)
    uri = tracker.uri if run_id else None
    if d.is_main:  # the other ranks have no tracker URI to name
        line = closing_line(metrics, epsilon, delta, steps, run_id, uri, audit=found,
                            experiment_id=tracker.experiment_id, unit=_unit(plan))
        tracker.set_tags({NOTE_TAG: line})  # the run's description in MLflow's UI
    tracker.finish("FINISHED")
    if d.is_main:
        if tracker.spooled:
            line += (f" | tracking server unreachable: spooled to {tracker.spooled}, upload with "
                     f"python -m workbench.tracking sync {output_dir}")
        print(line, flush=True)
    return TrainResult(metrics=metrics, epsilon=epsilon, delta=delta,
                       noise_multiplier=plan.noise_multiplier if plan.private else None, sample_rate=plan.sample_rate,
                       steps=steps, run_id=run_id, tracking_uri=uri,
                       output_dir=output_dir, checkpoint=last_saved[0], model=model, history=trainer.history,
                       audit=found)


def _unit(plan) -> str:
    """The unit of privacy of a mechanism: "user" (workbench/privacy/users.py) or "example"."""
    return getattr(plan, "unit", "example")


def _run_inputs(cfg: DictConfig, job: Job) -> list[dict]:
    """The training and evaluation data as MLflow run inputs, from metadata only: the config's data node (its target
    and arguments: the source), a digest of that node and N (not of the content), N, and for tensor datasets the shape
    and dtype of a row (every row has it). Nothing read from an example. At user level the training data's N is its
    number of users: the number of examples is not public there (one user's size would change it)."""
    out = []
    users = _unit(job.mechanism) == "user"
    for split, context, loader, count in (("train", "training", job.loader, job.mechanism.shard.population),
                                          ("eval", "eval", job.eval_loader, None)):
        node = cfg.data.get(split) if loader is not None else None
        if node is None:
            continue
        source = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else {"value": str(node)}
        dataset = loader.dataset
        count = count if count is not None else len(dataset)
        tensors = getattr(dataset, "tensors", None)
        features = [{"name": f"tensor_{i}", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape[1:])}
                    for i, t in enumerate(tensors)] if isinstance(tensors, (tuple, list)) else []
        target = str(source.get("_target_", "data")) if isinstance(source, dict) else "data"
        counted = "num_users" if users and split == "train" else "num_examples"
        out.append({"name": f"{split}: {target.rpartition('.')[2]}", "context": context, counted: int(count),
                    "source": json.dumps(source, sort_keys=True, default=str), "features": features,
                    "digest": hashlib.sha256(json.dumps([source, count], sort_keys=True, default=str).encode())
                    .hexdigest()[:8]})
    return out


def _log_model(cfg: DictConfig, tracker, model: nn.Module, plan, epsilon: float | None, steps: int,
               name: str = "model") -> None:
    """The trained model as the run's MLflow model `name` at step `steps` (pickled here, logged where the tracking
    store runs), the privacy budget as its metadata; the end's model ("model") alone is registered. A model that
    cannot be pickled is a warning and a tag, never a failed run."""
    privacy_meta = {"private": plan.private, "steps": steps, "privacy_unit": _unit(plan) if plan.private else None,
                    "privacy_adjacency": plan.adjacency}
    if plan.private:
        privacy_meta.update(epsilon=epsilon, delta=plan.delta, accountant=cfg.privacy.accountant,
                            noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate,
                            max_grad_norm=plan.max_grad_norm, mechanism=plan.kind,
                            **({"num_bands": plan.num_bands} if plan.kind == "bandmf" else {}))  # its rate is in-band
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.pt"
        try:
            # The trained weights in a freshly built copy: the trained module itself may carry the last batch's
            # per-example gradients (grad_sample) and activations, and the hooks holding them (hooks, ew, vmap modes).
            with torch.random.fork_rng(devices=[]):
                published, _ = build_model(cfg)
            published.load_state_dict(model.state_dict())
            torch.save(published, path)
        except Exception as e:  # noqa: BLE001 - an unpicklable module (a closure in a hook...): the run goes on
            message = " ".join(f"{type(e).__name__}: {e}".split())[:500]
            log.warning("the trained model cannot be logged as an MLflow model: %s", message)
            tracker.set_tags({"workbench.model_error": message})
            return
        tracker.log_model(path, {"name": name, "step": steps, "privacy": privacy_meta,
                                 "register": cfg.tracking.register_model if name == "model" else None})
