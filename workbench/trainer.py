"""The training loop (docs/DESIGN.md, step 4 and around it): Poisson batches -> the step (workbench/step.py) -> the
division by the expected global batch B (never the realised one) -> the optimizer; parameters stay identical on every
rank. Around it: the step log with each line's epsilon, evaluation, checkpoints, and a stop on non-finite releases.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from workbench.distributed import Dist
from workbench.errors import TrainingStopped
from workbench.privacy import EpsilonSchedule
from workbench.privacy.mechanism import Mechanism
from workbench.step import GradientStep

log = logging.getLogger(__name__)


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
    loss_published: bool = True  # False: the loss stays in this process (a private run's raw loss is not a DP release)


class StepLogger:
    """Logs step metrics off the training thread, so neither MLflow round trips (~10 ms each on SQLite) nor the
    accountant's epsilon (a PLD composition, ~0.1 s) stall a step.

    Lines are sent in one batch at most every ``SEND_INTERVAL`` seconds (and at every flush: checkpoints, the end).
    Every line of a private run carries the epsilon of its own step, from the run's :class:`EpsilonSchedule`.
    """

    SEND_INTERVAL = 1.0

    def __init__(self, tracker, schedule: EpsilonSchedule | None, delta: float | None = None,
                 publish_loss: bool = True):
        import queue
        import threading

        self.tracker, self.schedule = tracker, schedule
        self.history = History(delta=delta if schedule is not None else None, loss_published=publish_loss)
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
            self.history.steps.append(step)
            self.history.loss.append(metrics["loss"])
            if not self.history.loss_published:
                metrics = {k: v for k, v in metrics.items() if k != "loss"}
            batch.append((metrics, step))
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


@dataclass(frozen=True)
class LoopConfig:
    """What the loop reads from the job's config: when to log, evaluate and save, and whether to show progress."""

    start_step: int
    logging_steps: int = 10
    eval_steps: int = 0  # 0: only at the end
    save_steps: int = 0  # 0: only at the end
    progress_bar: bool = True
    log_train_loss: bool | None = None  # None: only for a non-private run (see Trainer.publishes_loss)

    @classmethod
    def of(cls, cfg, start_step: int, show: bool) -> "LoopConfig":
        return cls(start_step, cfg.logging_steps, cfg.eval_steps or 0, cfg.save_steps or 0,
                   show and not cfg.disable_tqdm, cfg.tracking.get("log_train_loss"))


class Trainer:
    """The loop: Poisson batches -> GradientStep -> optimizer, with logging, eval, checkpoints and the budget stop.
    ``mechanism`` says how many steps to take, the expected batch B to divide by, and what each step spends."""

    def __init__(self, loop: LoopConfig, dist: Dist, mechanism: Mechanism, model: nn.Module, step_fn: GradientStep,
                 optimizer, scheduler, loader, evaluator, tracker, save_fn: Callable[[int], None], callbacks=None):
        from workbench.callbacks import CallbackList

        self.loop, self.dist, self.mechanism, self.model, self.step_fn = loop, dist, mechanism, model, step_fn
        self.callbacks = callbacks or CallbackList([], model, [], mechanism.steps)
        self.optimizer, self.scheduler, self.loader, self.evaluator = optimizer, scheduler, loader, evaluator
        self.accountant, self.delta, self.tracker = mechanism.accountant, mechanism.delta, tracker
        self.population, self.expected_batch = mechanism.shard.population, mechanism.expected_batch
        self.total_steps, self.start_step, self.save_fn = mechanism.steps, loop.start_step, save_fn
        self.history = History()
        self.failed_step: int | None = None

    @property
    def publishes_loss(self) -> bool:
        """Whether the training loss goes to the tracker. A private run's loss is an exact statistic of its sampled
        batch, outside what epsilon covers, so it stays on the console and in the result unless the user asks
        (tracking.log_train_loss=true, and the run is then tagged non_dp_metrics=loss)."""
        chosen = self.loop.log_train_loss
        return not self.mechanism.private if chosen is None else bool(chosen)

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

        loop, step = self.loop, self.start_step
        bar = tqdm(total=self.total_steps, initial=step, desc="train", dynamic_ncols=True, disable=not loop.progress_bar)
        schedule = None
        if self.accountant is not None and (self.dist.is_main or not bar.disable):
            schedule = EpsilonSchedule(self.accountant, self.delta, logging_steps(step, self.total_steps, loop.logging_steps))
        logger = StepLogger(self.tracker, schedule if self.dist.is_main else None, self.delta, self.publishes_loss)
        if self.mechanism.private and self.publishes_loss:
            self.tracker.set_tags({"non_dp_metrics": "loss"})
        window_loss, window_count, window_steps, window_start = 0.0, 0.0, 0, time.perf_counter()
        self.model.train()
        self.callbacks.on_train_begin(step)
        try:
            for batch in self.loader:
                loss_sum, count = self.step_fn(batch, step)
                self.step_fn.divide_(self.expected_batch)
                for group in self.optimizer.param_groups:  # DP-AdamBC's s: this step's (adaptive clipping moves C_t)
                    if "noise_std" in group and self.mechanism.private:
                        group["noise_std"] = self.step_fn.released_noise_std
                self.optimizer.step()
                self.callbacks.on_step_end(step + 1)  # p.grad is still the released update here
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
                if self.accountant is not None:
                    self.accountant.step()
                step += 1
                self._stop_if_not_finite(step)
                window_loss, window_count, window_steps = window_loss + loss_sum, window_count + count, window_steps + 1
                bar.update(1)
                if step % loop.logging_steps == 0 or step == self.total_steps:  # as logging_steps() lists them
                    elapsed = time.perf_counter() - window_start
                    loss = window_loss / max(window_count, 1.0)
                    line = {"loss": loss, "learning_rate": self.scheduler.get_last_lr()[0],
                            # expected examples (the realised count of a Poisson batch is private)
                            "samples_per_second": window_steps * self.expected_batch / max(elapsed, 1e-9),
                            "epoch": step * self.expected_batch / self.population}
                    if self.mechanism.adaptive:  # C after this step (released: a function of the noised counts)
                        line["clip_norm"] = self.step_fn.clip_norm
                    logger.log(step, line)
                    known = schedule.latest(step) if schedule is not None else None  # never waits
                    bar.set_postfix(loss=f"{loss:.4f}", **({"eps": f"{known[1]:.3f}" + ("" if known[0] == step else
                                                                                        f"@{known[0]}")} if known else {}))
                    window_loss, window_count, window_steps, window_start = 0.0, 0.0, 0, time.perf_counter()
                if loop.eval_steps and step % loop.eval_steps == 0 and step < self.total_steps:
                    self.tracker.log_metrics(self.evaluator(), step)
                    self.model.train()
                if loop.save_steps and step % loop.save_steps == 0 and step < self.total_steps:
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
