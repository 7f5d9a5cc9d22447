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


# The promise (docs/DESIGN.md, "Sampling"; config.py's secure_seed): the noise is unknowable to whoever knows the config.
# Two runs of one config differ through the batches alone as well, so the noise is read here with the batches out of
# the picture: drawn from the job's own noise objects (what its steps add), for two secrets and one public config.
MECHANISMS = {"dpsgd": [], "bandmf": ["privacy.mechanism=bandmf"], "blt": ["privacy.mechanism=blt"],
              "adaptive": ["privacy.clipping=adaptive"]}
PUBLIC_SEED = 42
SECRETS = (918273645, 564738291)  # not small constants a public derivation could put in the secret's place


def _job_noise(secret: int, overrides: list[str], steps: int = 4) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradient noise (and the clipped count's noise, where there is one) that a job built from a public config
    with ``secure_seed=secret`` adds at steps 0..steps-1, drawn from its noise objects onto zeros."""
    from workbench import compose
    from workbench.job import build

    cfg = compose(["experiment=quick", "tracking.enabled=false", f"seed={PUBLIC_SEED}", "privacy.noise_multiplier=1.0",
                   "privacy.target_epsilon=null", f"privacy.secure_seed={secret}", *overrides])
    step_fn = build(cfg, setup("gloo"), None, []).step_fn
    grads, counts = [], []
    for t in range(steps):  # in order: the correlated mechanisms refuse any other
        update = torch.zeros(step_fn.noise.numel)
        step_fn.noise.add_(update, t)
        grads.append(update)
        if step_fn.count_noise is not None:
            slot = torch.zeros(())
            step_fn.count_noise.add_(slot, t)
            counts.append(slot)
    return grads, counts


def _public_draws(numel: int, step: int) -> list[torch.Tensor]:
    """What N(0, I) draws for ``step`` would be if they were seeded from public values only: the config's seed (and
    step) through each derivation the code could plausibly use, with no secret or a constant in its place."""
    from workbench.privacy.sampling import COUNT_NOISE_STREAM, NOISE_STREAM, SAMPLING_STREAM, seed_sequence_64, \
        step_generator, stream_seed

    seeds = {PUBLIC_SEED, PUBLIC_SEED + step, seed_sequence_64([PUBLIC_SEED]), *(stream_seed(c, PUBLIC_SEED) for c in (0, 1)),
             stream_seed(PUBLIC_SEED, PUBLIC_SEED), stream_seed(PUBLIC_SEED, 0)}
    draws = [torch.randn(numel, generator=torch.Generator().manual_seed(s)) for s in seeds]
    for s in seeds:
        for stream in (SAMPLING_STREAM, NOISE_STREAM, COUNT_NOISE_STREAM):
            draws.append(torch.randn(numel, generator=step_generator(s, 0, step, stream=stream)))
    return draws


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_the_noise_depends_on_the_secret_not_only_on_the_public_seed(mechanism):
    """With the batch stream out of the picture, two secrets under one public config give different noise at every
    step (gradient noise, and adaptive clipping's count noise), and none of it is a public draw: the first step's
    noise (sigma C z_0 times a public constant, correlated mechanisms included) is uncorrelated with every N(0, I)
    draw seeded from the public seed and step alone (|r| ~ 1/sqrt(numel) ~ 0.01 by chance; 1 if it were one)."""
    one, one_counts = _job_noise(SECRETS[0], MECHANISMS[mechanism])
    other, other_counts = _job_noise(SECRETS[1], MECHANISMS[mechanism])
    again, _ = _job_noise(SECRETS[0], MECHANISMS[mechanism])
    assert all(torch.equal(a, b) for a, b in zip(one, again))  # the secret's noise is reproducible (resume needs it)
    assert all(float(a.std()) > 0.5 for a in one)  # sigma = C = 1: there is noise to compare
    for t, (a, b) in enumerate(zip(one, other)):
        assert abs(_correlation(a, b)) < 0.1, f"step {t}: the noise of two secrets is the same draw"
    for draw in _public_draws(one[0].numel(), 0):
        assert abs(_correlation(one[0], draw)) < 0.1, "the noise is a draw seeded from public values"
    if mechanism == "adaptive":
        assert len(one_counts) == len(other_counts) == 4 and all(float(c) != 0.0 for c in one_counts)
        assert all(float(a) != float(b) for a, b in zip(one_counts, other_counts))
