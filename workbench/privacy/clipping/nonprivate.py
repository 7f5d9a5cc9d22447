"""The non-private twin: plain summed gradients, no clipping, through the same flat buffer (and so the same single
all-reduce) as the private strategies, so both paths are measured alike."""

from __future__ import annotations

import torch
from torch import nn

from workbench.privacy.clipping.base import LossFn, Strategy, add_grads


class Summed(Strategy):
    def __init__(self, model: nn.Module, params: list[nn.Parameter]):
        self.module, self.params = model, params

    def accumulate(self, batch, loss_fn: LossFn, view_of: dict[int, torch.Tensor]) -> torch.Tensor:
        losses = loss_fn(self.module, batch)
        losses.sum().backward()
        add_grads(self.params, view_of)
        return losses.detach()
