"""Small models that train in seconds on CPU. Any ``torch.nn.Module`` plugs in by config (``model._target_``)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: Sequence[int] = (128,), num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """For 8x8 single-channel images (digits as 1x8x8). GroupNorm, not BatchNorm: DP-SGD needs per-example independence."""

    def __init__(self, num_classes: int = 10, channels: int = 16):
        super().__init__()
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, channels, 3, padding=1), nn.GroupNorm(4, channels), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1, stride=2), nn.GroupNorm(4, 2 * channels), nn.ReLU(),
            nn.Flatten(), nn.Linear(2 * channels * 16, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
