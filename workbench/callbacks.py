"""Training callbacks (Hugging Face style): objects with any of ``on_train_begin``, ``on_step_end``, ``on_train_end``.

Set them in config (``callbacks: [{_target_: my.module.Monitor}]``) or pass them to ``workbench.train(cfg,
callbacks=[...])``. Each hook gets one :class:`StepState` and returns nothing. Hooks run on every rank (what they see is
identical on all ranks), on the training thread: keep them quick.

What a hook sees is what DP-SGD releases, so a callback costs no privacy (post-processing):

- ``on_train_begin(state)``: ``step`` (the first step to run: 0, or the resumed step), ``total_steps``, ``model``;
  ``updates`` is empty.
- ``on_step_end(state)``: after the optimizer step. ``updates`` maps each trainable parameter's name to its released
  update of this step: the sum of clipped per-sample gradients plus the noise, all-reduced and divided by the expected
  batch B (non-private runs: the plain gradient sum / B). The tensors are views into the trainer's buffer, valid only
  during the call: ``.clone()`` what you keep, never write to them. ``model`` holds the parameters after the step.
- ``on_train_end(state)``: after the last step, before the final eval; ``updates`` is empty.

No hook sees a batch, a per-example gradient, a loss of training examples, or the stream secret (the seed of the
sampling and noise streams). In an audited run (``audit=canaries``) ``updates`` also carries the canary block as
``audit.canaries``; ``model`` is always the user's model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

HOOKS = ("on_train_begin", "on_step_end", "on_train_end")


@dataclass
class StepState:
    step: int  # logical steps completed
    total_steps: int
    model: nn.Module
    updates: dict[str, torch.Tensor] = field(default_factory=dict)


class CallbackList:
    """The trainer's one handle on every callback; built once per run with the names of the trained parameters."""

    def __init__(self, callbacks: Sequence[Any], model: nn.Module, named_params: Sequence[tuple[str, nn.Parameter]],
                 total_steps: int):
        self.callbacks = list(callbacks)
        self.model, self.named_params, self.total_steps = model, list(named_params), total_steps

    def _call(self, hook: str, state: StepState) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(state)

    def on_train_begin(self, step: int) -> None:
        self._call("on_train_begin", StepState(step, self.total_steps, self.model))

    def on_step_end(self, step: int) -> None:
        """Call after the optimizer step and before the gradients are cleared: ``p.grad`` is the released update."""
        if self.callbacks:
            updates = {name: p.grad for name, p in self.named_params if p.grad is not None}
            self._call("on_step_end", StepState(step, self.total_steps, self.model, updates))

    def on_train_end(self, step: int) -> None:
        self._call("on_train_end", StepState(step, self.total_steps, self.model))


def check(callbacks: Sequence[Any]) -> None:
    """Refuse an object with no hook at all (most likely a misspelt method), before any work."""
    from workbench.errors import WorkbenchError

    for cb in callbacks:
        if not any(callable(getattr(cb, h, None)) for h in HOOKS):
            raise WorkbenchError(f"callback {type(cb).__name__} has none of {', '.join(HOOKS)}")
