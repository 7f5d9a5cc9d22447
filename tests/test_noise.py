"""The noise draw (workbench/privacy/noise.py) as the step adds it: standard deviation sigma C, on every step, an
empty Poisson batch included, and the same noise again for the same step (a resumed run draws what the uninterrupted
one would have). That it is added once cluster-wide: tests/test_distributed.py."""

import pytest
import torch
from torch import nn

from workbench.distributed import setup
from workbench.step import GradientStep


def test_noise_std_is_sigma_times_clip_and_reproducible():
    d = setup("gloo")
    model = nn.Linear(100, 50)
    sigma, clip = 1.3, 0.7
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=clip, noise_multiplier=sigma)
    samples = []
    for s in range(20):
        step(None, step=s)  # an empty Poisson batch: the gradient is pure noise
        samples.append(torch.cat([p.grad.flatten() for p in step.params]))
    noise = torch.stack(samples)
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.02)
    assert abs(float(noise.mean())) < 0.01
    step(None, step=3)
    assert torch.equal(torch.cat([p.grad.flatten() for p in step.params]), samples[3])
