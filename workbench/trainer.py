"""The DP-SGD training loop (the privacy contract of docs/DESIGN.md, step by step).

Every logical step, on every rank, whatever its Poisson batch (even empty):
  1. per-sample gradients of the local batch, in physical micro-batches of at most ``max_physical_batch_size``;
  2. flat per-sample L2 clipping to C, summed locally into one flat buffer;
  3. one all-reduce of that buffer; Gaussian noise of std sigma*C is added by rank 0 alone, before the all-reduce,
     so it is in the sum exactly once;
  4. divide by the expected global batch B (never the realised one), optimizer step: parameters stay identical.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import contextlib

import torch
from torch import nn

from workbench.privacy import clipping
from workbench.data import Batch, as_batch, step_generator
from workbench.distributed import Dist, pad_concat
from workbench.errors import TrainingStopped, WorkbenchError
from workbench.losses import logits_of
from workbench.privacy import EpsilonSchedule

log = logging.getLogger(__name__)
# Opacus' hooks trigger this on every backward of a model whose inputs need no grad: expected, not actionable.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")


CHECK_EXAMPLES = 8  # examples the pre-run check compares against autograd's per-example gradients


FP16_LOSS_SCALE = 2.0 ** 10  # fp16_loss_scale's default (workbench/config.py)


class GradientStep:
    """Steps 1-3 of the contract: the noised, all-reduced sum of clipped per-sample gradients for one logical step.

    With ``max_grad_norm=None`` it is the non-private twin: plain summed gradients, no clipping, no noise, through the
    same single all-reduce, so both paths are measured alike.
    """

    def __init__(self, model: nn.Module, criterion: nn.Module, dist: Dist, *, max_grad_norm: float | None,
                 noise_multiplier: float, grad_sample_mode: str = "hooks", max_physical_batch_size: int = 512,
                 noise_seed: int = 0, autocast_dtype: torch.dtype | None = None, loss_scale: float | None = None):
        self.dist, self.criterion, self.autocast_dtype = dist, criterion, autocast_dtype
        # fp16's narrow range needs the loss scaled (bf16 has float32's exponent range and needs none); see _losses
        self.scale = float(loss_scale if loss_scale is not None else
                           FP16_LOSS_SCALE if autocast_dtype == torch.float16 else 1.0)
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise WorkbenchError(f"the loss scale must be a finite number > 0, got {loss_scale}")
        self.clip, self.sigma, self.mode = max_grad_norm, noise_multiplier, grad_sample_mode
        self.max_physical_batch_size, self.noise_seed = max_physical_batch_size, noise_seed
        self.private = max_grad_norm is not None
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise WorkbenchError("the model has no trainable parameters")
        if len({p.dtype for p in self.params}) > 1:
            raise WorkbenchError(f"the model's trainable parameters mix dtypes {sorted({str(p.dtype) for p in self.params})}; "
                                 "one flat gradient buffer needs one")
        if self.private and self.mode == "auto":
            self.mode = clipping.fastest_grad_sample_mode(model)
        self.clipper = clipping.make(model, self.params, max_grad_norm=max_grad_norm, mode=self.mode)
        self.clipper.max_batch = max_physical_batch_size
        self.module = self.clipper.module
        if self.private and autocast_dtype is not None and self.mode == "ew":
            raise WorkbenchError(f"grad_sample_mode={self.mode} cannot run in mixed precision: its clipped sum is not "
                                 "computed from the per-sample gradients its norms were; use bk or hooks")
        numel = sum(p.numel() for p in self.params)
        device = self.params[0].device
        if autocast_dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise WorkbenchError(f"bf16=true: {torch.cuda.get_device_name(device)} has no bfloat16; use fp16=true")
        # Gradient sum, then [loss sum, example count]: the step's one collective carries all three.
        self.flat = torch.zeros(numel + 2, device=device, dtype=self.params[0].dtype)
        self.grad_views, offset = [], 0
        for p in self.params:
            self.grad_views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.view_of = {id(p): view for p, view in zip(self.params, self.grad_views)}
        self.numel = numel
        self.loss_sum, self.count = self.flat[-2], self.flat[-1]  # 0-d views: cheaper to add to than flat[-2]
        self._update, self._totals = self.flat[:numel], self.flat[numel:]  # views made once, not per step
        self._noise = torch.empty(numel if self.private else 0, device=device)  # reused: no allocation per step

    def check(self, batch: Any) -> None:
        """Before any training, on a real batch: the criterion gives one loss per example, and the strategy's
        assumptions about the model hold (book-keeping's cannot all be read off the layers). Run in the parameters'
        precision: the checks compare against autograd there."""
        self.clipper.check(self._to_device(batch), self._precise_losses)

    def _forward(self, module: nn.Module, batch: Batch) -> Any:
        # Opacus' ew wrapper reads the batch size off a positional input (the pre-run check also calls the bare model)
        if self.private and self.mode == "ew" and module is self.module:
            from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

            module = call_for_per_sample_grads(module._module, batch_size=len(batch), loss_reduction="sum")
        return batch.forward(module)

    def _precise_losses(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        """The loss function the clipping strategies call: forward ``module`` on the micro-batch, one loss per example."""
        losses = self.criterion(logits_of(self._forward(module, batch)), batch.labels)
        if losses.dim() != 1 or len(losses) != len(batch):
            raise WorkbenchError(f"the criterion must return one loss per example (reduction='none'), not shape "
                                 f"{tuple(losses.shape)} for a batch of {len(batch)}")
        return losses.float()

    def _losses(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        """As _precise_losses, under autocast with bf16/fp16 (norms and clipping stay float32: clipping/), times the
        loss scale S (fp16: ``fp16_loss_scale``; 1 otherwise), so that small gradients survive the fp16 backward.

        Inside the contract: clipping to C*S and noise of std sigma*C*S, divided by S, give DP-SGD's own update (every
        clip factor is unchanged). S is fixed, not dynamic as torch's GradScaler: an example whose backward overflows
        contributes 0 (clipping/base.py), so the released update stays finite and no overflow is ever seen to adapt
        to, nor may it be (whether one occurred depends on one example's data). Per-example losses are summed, not
        averaged over the batch: the gradient at the logits reaches S itself, hence 2**10 and not GradScaler's 2**16."""
        if self.autocast_dtype is None:  # entering a disabled autocast still costs more than the MLP's loss
            losses = self._precise_losses(module, batch)
        else:
            with torch.autocast(self.flat.device.type, dtype=self.autocast_dtype):
                losses = self._precise_losses(module, batch)
        return losses if self.scale == 1.0 else losses * self.scale

    def _to_device(self, batch: Any) -> Batch:
        return as_batch(batch).to(self.flat.device, non_blocking=True)

    def _micro_batches(self, batch: Batch):
        if len(batch) <= self.max_physical_batch_size:  # at most one micro-batch: the batch itself, no slicing
            if len(batch):  # an empty draw has none (the step still adds noise and joins the all-reduce)
                yield batch
            return
        for start in range(0, len(batch), self.max_physical_batch_size):
            yield batch.slice(start, start + self.max_physical_batch_size)

    def __call__(self, batch: Any, step: int) -> tuple[float, float]:
        """Fill each parameter's .grad with the noised clipped sum; return the cluster-wide (loss sum, example count)."""
        self.flat.zero_()
        for p in self.params:  # a .grad left from outside (no zero_grad) must not leak unclipped into the backward modes
            p.grad = None
        scale = self.scale
        if self.private:
            self.clipper.clip = self.clip * scale  # scaled losses, scaled bound: every clip factor is unchanged
        if batch is not None:  # 1-2: per-sample gradients, clipped and summed into the flat buffer
            for micro_batch in self._micro_batches(self._to_device(batch)):
                if getattr(self.clipper, "checked", True) is False:  # normally check() ran before training
                    # on a few examples, as run.py does: the check is one autograd call per example
                    self.clipper.check(micro_batch.slice(0, CHECK_EXAMPLES), self._precise_losses)
                losses = self.clipper.accumulate(micro_batch, self._losses, self.view_of)
                self.loss_sum.add_(losses.sum() if scale == 1.0 else losses.sum() / scale)
                self.count.add_(len(losses))
        if self.private and self.sigma > 0 and self.dist.rank == 0:
            g = step_generator(self.noise_seed, 0, step, stream=1, device=self.flat.device)
            noise = torch.randn(self.numel, generator=g, device=self.flat.device, out=self._noise)
            # std sigma*C*S; mul_, not add_'s alpha, which refuses a factor past float32's range
            self._update.add_(noise.mul_(self.sigma * self.clip * scale))
        self.dist.all_reduce_(self.flat)
        for p, view in zip(self.params, self.grad_views):
            p.grad = view  # a view into the reduced buffer: no copy; the next step re-zeroes the buffer
        loss_sum, count = self._totals.tolist()  # one host read for both
        return loss_sum, count

    def divide_(self, expected_batch: float) -> None:
        """Step 4's division of every gradient by the expected batch B (and the loss scale S), in one operation on the
        reduced buffer."""
        self._update.div_(expected_batch * self.scale)

    @property
    def update(self) -> torch.Tensor:
        """The step's released update (noised, all-reduced), as a flat view."""
        return self._update


def logging_steps(start_step: int, total_steps: int, every: int) -> list[int]:
    """The steps after ``start_step`` that get a log line: every ``every`` steps, and the last."""
    return [s for s in range(start_step + 1, total_steps + 1) if s % every == 0 or s == total_steps]


def lr_lambda(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Hugging Face's schedules: constant, constant_with_warmup, linear, cosine (warmup applies to the last three)."""

    def f(step: int) -> float:
        if kind != "constant" and step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return f


@dataclass
class History:
    """What the run logged, kept for the closing plot and the result object."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    epsilon: list[float] = field(default_factory=list)  # empty for a non-private run
    delta: float | None = None


class StepLogger:
    """Logs step metrics off the training thread, so neither MLflow round trips (~10 ms each on SQLite) nor the
    accountant's epsilon (a PLD composition, ~0.1 s) stall a step.

    Lines are sent in one batch at most every ``SEND_INTERVAL`` seconds (and at every flush: checkpoints, the end).
    Every line of a private run carries the epsilon of its own step, from the run's :class:`EpsilonSchedule`.
    """

    SEND_INTERVAL = 1.0

    def __init__(self, tracker, schedule: EpsilonSchedule | None, delta: float | None = None):
        import queue
        import threading

        self.tracker, self.schedule = tracker, schedule
        self.history = History(delta=delta if schedule is not None else None)
        self._queue: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._error: BaseException | None = None
        self._next_send = 0.0
        self._thread = threading.Thread(target=self._work, name="workbench-step-logger", daemon=True)
        self._thread.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._error is not None:
            raise RuntimeError("step logging failed") from self._error
        self._queue.put((step, metrics))

    def _work(self) -> None:
        while True:
            backlog = [self._queue.get()]
            if self._wake.wait(max(0.0, self._next_send - time.monotonic())):
                self._wake.clear()
            while not self._queue.empty():
                backlog.append(self._queue.get())
            stop = None in backlog
            lines = [b for b in backlog if b is not None]
            try:
                self._send(lines)
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
                self._error = e
            finally:
                self._next_send = time.monotonic() + self.SEND_INTERVAL
                for _ in backlog:
                    self._queue.task_done()
            if stop or self._error is not None:
                return

    def _send(self, lines: list) -> None:
        batch = []
        for step, metrics in lines:
            if self.schedule is not None:
                metrics = {**metrics, "epsilon": self.schedule.get(step)}
                self.history.epsilon.append(metrics["epsilon"])
            batch.append((metrics, step))
            self.history.steps.append(step)
            self.history.loss.append(metrics["loss"])
        if batch:
            self.tracker.log_many(batch)

    def flush(self) -> None:
        """Wait until every queued line is in the tracker (before a checkpoint: a resumed run then misses none)."""
        self._wake.set()
        done = self._queue.all_tasks_done
        with done:  # not Queue.join(): a worker that stopped on an error never marks later lines done
            while self._queue.unfinished_tasks and self._thread.is_alive():
                done.wait(0.1)
        self.tracker.flush()
        if self._error is not None:
            raise RuntimeError("step logging failed") from self._error

    def close(self) -> History:
        self._queue.put(None)
        self._wake.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("step logging failed") from self._error
        return self.history


class Trainer:
    """The loop: Poisson batches -> GradientStep -> optimizer, with logging, eval, checkpoints and the budget stop."""

    def __init__(self, cfg, dist: Dist, model: nn.Module, step_fn: GradientStep, optimizer, scheduler, loader,
                 evaluator, accountant, delta: float | None, tracker, expected_batch: float, population: int,
                 total_steps: int, start_step: int, save_fn: Callable[[int], None], callbacks=None):
        from workbench.callbacks import CallbackList

        self.cfg, self.dist, self.model, self.step_fn = cfg, dist, model, step_fn
        self.callbacks = callbacks or CallbackList([], model, [], total_steps)
        self.optimizer, self.scheduler, self.loader, self.evaluator = optimizer, scheduler, loader, evaluator
        self.accountant, self.delta, self.tracker = accountant, delta, tracker
        self.population = population
        self.expected_batch, self.total_steps, self.start_step, self.save_fn = expected_batch, total_steps, start_step, save_fn
        self.history = History()
        self.failed_step: int | None = None

    def _stop_if_not_finite(self, step: int) -> None:
        """Stop on NaN/inf in what the step released: the noised update and the new parameters. Reading them is
        post-processing (no privacy cost); the training loss, a function of the raw batch, is never consulted.
        Every rank holds the same update and parameters, so every rank stops at the same step."""
        update = self.step_fn.update
        finite = [torch.isfinite(update).all(), *(torch.isfinite(p).all() for p in self.step_fn.params)]
        if bool(torch.stack(finite).all()):
            return
        what = "the noised update" if not bool(finite[0]) else "the parameters"
        raise TrainingStopped(f"training stopped at step {step}: {what} became non-finite (NaN/inf); try a "
                              "lower learning_rate, and check the data for NaN/inf; checkpoints of earlier steps are kept")

    def fit(self) -> int:
        """Train from start_step to total_steps; returns the number of steps taken in all."""
        from tqdm import tqdm

        cfg, step = self.cfg, self.start_step
        bar = tqdm(total=self.total_steps, initial=step, desc="train", dynamic_ncols=True,
                   disable=cfg.disable_tqdm or not self.dist.should_log)
        schedule = None
        if self.accountant is not None and (self.dist.is_main or not bar.disable):
            schedule = EpsilonSchedule(self.accountant, self.delta, logging_steps(step, self.total_steps, cfg.logging_steps))
        logger = StepLogger(self.tracker, schedule if self.dist.is_main else None, self.delta)
        window_loss, window_count, window_start = 0.0, 0.0, time.perf_counter()
        self.model.train()
        self.callbacks.on_train_begin(step)
        try:
            for batch in self.loader:
                loss_sum, count = self.step_fn(batch, step)
                self.step_fn.divide_(self.expected_batch)
                self.optimizer.step()
                self.callbacks.on_step_end(step + 1)  # p.grad is still the released update here
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
                if self.accountant is not None:
                    self.accountant.step()
                step += 1
                self._stop_if_not_finite(step)
                window_loss, window_count = window_loss + loss_sum, window_count + count
                bar.update(1)
                if step % cfg.logging_steps == 0 or step == self.total_steps:  # as logging_steps() lists them
                    elapsed = time.perf_counter() - window_start
                    loss = window_loss / max(window_count, 1.0)
                    logger.log(step, {"loss": loss, "learning_rate": self.scheduler.get_last_lr()[0],
                                      "samples_per_second": window_count / max(elapsed, 1e-9),
                                      "epoch": step * self.expected_batch / self.population})
                    known = schedule.latest(step) if schedule is not None else None  # never waits
                    bar.set_postfix(loss=f"{loss:.4f}", **({"eps": f"{known[1]:.3f}" + ("" if known[0] == step else
                                                                                        f"@{known[0]}")} if known else {}))
                    window_loss, window_count, window_start = 0.0, 0.0, time.perf_counter()
                if cfg.eval_steps and step % cfg.eval_steps == 0 and step < self.total_steps:
                    self.tracker.log_metrics(self.evaluator(), step)
                    self.model.train()
                if cfg.save_steps and step % cfg.save_steps == 0 and step < self.total_steps:
                    logger.flush()
                    self.save_fn(step)
            self.callbacks.on_train_end(step)
        except KeyboardInterrupt as e:  # SIGINT / SIGTERM (workbench.interrupt): say where the run stopped
            e.step = step
            raise
        except Exception:
            self.failed_step = step  # the step whose batch failed: the job looks for a bad example in it
            raise
        finally:
            self.history = logger.close()
            bar.close()
        return step


class Evaluator:
    """Cluster-wide eval: each rank predicts its contiguous shard, ranks gather in order, metrics see the whole set."""

    def __init__(self, model: nn.Module, criterion: nn.Module, loader, dist: Dist,
                 compute_metrics: Callable | None, use_gather_object: bool = False, batch_eval_metrics: bool = False,
                 autocast_dtype: torch.dtype | None = None):
        self.model, self.criterion, self.loader, self.dist = model, criterion, loader, dist
        self.compute_metrics, self.force_object, self.batched = compute_metrics, use_gather_object, batch_eval_metrics
        self.autocast_dtype = autocast_dtype

    def _gather(self, predictions, labels):
        from workbench.metrics import EvalPrediction

        return EvalPrediction(self.dist.gather_payload(predictions, self.force_object),
                              self.dist.gather_payload(labels, self.force_object))

    def _predict(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, per-example losses), both float32."""
        with torch.autocast(self.dist.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = logits_of(batch.forward(self.model))
            return out.float(), self.criterion(out, batch.labels).float()

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        totals = torch.zeros(2, device=self.dist.device)  # loss sum, example count
        predictions, labels, metrics = [], [], {}
        batches = iter(self.loader)  # streamed: the eval set is never held twice
        n_batches = max(self.dist.all_gather_object(len(self.loader))) if self.batched else len(self.loader)
        for i in range(n_batches):
            batch = as_batch(next(batches, None))
            if batch is not None and len(batch):
                batch = batch.to(self.dist.device, non_blocking=True)
                out, losses = self._predict(batch)
                totals[0] += losses.sum()
                totals[1] += len(batch)
                out, y = out.cpu(), batch.labels.cpu()
            else:  # this rank's shard has fewer eval batches: it joins the gather with an empty payload
                out, y = torch.empty(0), torch.empty(0, dtype=torch.long)
            if self.compute_metrics is None:
                continue
            if self.batched:
                metrics = self.compute_metrics(self._gather(out, y), compute_result=i == n_batches - 1)
            elif len(y):
                predictions.append(out)
                labels.append(y)
        if not self.batched and self.compute_metrics is not None:
            metrics = self.compute_metrics(self._gather(pad_concat(predictions, torch.empty(0)),
                                                        pad_concat(labels, torch.empty(0, dtype=torch.long))))
        self.dist.all_reduce_(totals)
        self.model.train(was_training)
        out = {f"eval_{k}": float(v) for k, v in (metrics or {}).items()}
        out["eval_loss"] = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
        if getattr(self.criterion, "reports_perplexity", False):
            out["eval_perplexity"] = math.exp(min(out["eval_loss"], 700.0))
        return out
