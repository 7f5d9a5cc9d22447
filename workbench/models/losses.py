"""Model outputs and per-example losses: what "one example's loss" means for every model the trainer accepts.

A model may return a tensor or an object with ``.logits`` (a Hugging Face ``ModelOutput``). The criterion must give one
loss per example (``reduction="none"``). For token sequences, :class:`TokenCrossEntropy` gives each example the mean
over its own non-ignored tokens, so clipping bounds one example's whole contribution, never one token's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from workbench.errors import WorkbenchError


def logits_of(output: Any) -> torch.Tensor:
    """The tensor a criterion reads: the output itself, or its ``.logits`` (HF), or the first of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise WorkbenchError(f"the model returned a {type(output).__name__}: it must return a tensor or an object with "
                         ".logits (a Hugging Face ModelOutput)")


class TokenCrossEntropy(nn.Module):
    """Language-model cross-entropy, one loss per example: the mean over that example's tokens whose label is not
    ``ignore_index``. ``shift=True`` (causal LM) predicts token t+1 from position t, as HF's causal models do; an
    example with no token to predict has loss 0 (and gradient 0). Logits (B, T, V), labels (B, T) -> (B,)."""

    reports_perplexity = True  # the evaluator logs exp(eval_loss) as eval_perplexity

    def __init__(self, shift: bool = True, ignore_index: int = -100, reduction: str = "none"):
        super().__init__()
        if reduction != "none":
            raise WorkbenchError("TokenCrossEntropy gives one loss per example: reduction must be 'none'")
        self.shift, self.ignore_index = shift, ignore_index

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if logits.dim() != 3 or labels.shape != logits.shape[:2]:
            raise WorkbenchError(f"TokenCrossEntropy needs logits (batch, tokens, vocab) and labels (batch, tokens), got "
                                 f"{tuple(logits.shape)} and {tuple(labels.shape)}")
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        per_token = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=self.ignore_index,
                                    reduction="none")  # (B, T); ignored tokens are 0
        tokens = (labels != self.ignore_index).sum(1)
        return per_token.sum(1) / tokens.clamp(min=1)
