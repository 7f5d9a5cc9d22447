"""DP-AdamW with bias correction (workbench/optim.py, optimizer=dp_adamw): a hand computation, torch's AdamW at zero
noise, and a short private run."""

import functools
import math

import pytest
import torch

from workbench.errors import WorkbenchError
from workbench.optim import DPAdamW


def test_one_step_equals_a_hand_computation():
    lr, b1, b2, eps, wd, s, gamma = 0.1, 0.9, 0.99, 1e-8, 0.01, 0.5, 1e-6
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.3], dtype=torch.float64))
    opt = DPAdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, noise_std=s, gamma=gamma)
    grads = [[0.8, -0.1, 0.6], [1.2, 0.05, -0.7]]
    theta, m, v = [1.0, -2.0, 0.3], [0.0] * 3, [0.0] * 3
    for t, g in enumerate(grads, start=1):
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        for i in range(3):
            theta[i] *= 1 - lr * wd
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            m_hat, v_hat = m[i] / (1 - b1 ** t), v[i] / (1 - b2 ** t)
            theta[i] -= lr * m_hat / (math.sqrt(max(v_hat - s * s, gamma)) + eps)
    assert p.detach().tolist() == pytest.approx(theta, rel=1e-12)
    # the floor is hit: coordinate 1's v^ is below s^2 at both steps, so its step is lr m^ / sqrt(gamma), not Adam's
    assert (0.05 ** 2 * 0.01 + 0.1 ** 2 * 0.0099) / (1 - 0.99 ** 2) < s * s


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_zero_noise_is_torch_adamw(wd):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 4))
    b = torch.nn.Parameter(a.detach().clone())
    ours = DPAdamW([a], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd, noise_std=0.0, gamma=0.0)
    theirs = torch.optim.AdamW([b], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd, foreach=False)
    for _ in range(7):
        g = torch.randn(5, 4)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        assert torch.equal(a, b)  # bit for bit


def test_noise_correction_moves_further_than_adam():
    """The correction's point: with noise, v^ - s^2 < v^, so each step is larger than AdamW's."""
    torch.manual_seed(1)
    a = torch.nn.Parameter(torch.zeros(1000))
    b = torch.nn.Parameter(torch.zeros(1000))
    ours, theirs = DPAdamW([a], lr=0.01, noise_std=1.0), DPAdamW([b], lr=0.01, noise_std=0.0)
    for _ in range(20):
        g = 0.3 + torch.randn(1000)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert a.mean() < b.mean() < 0  # both descend along the signal; the corrected one further


def test_bad_arguments():
    p = [torch.nn.Parameter(torch.zeros(1))]
    for kwargs in ({"noise_std": -1.0}, {"gamma": -1.0}, {"betas": (1.0, 0.9)}, {"lr": -0.1}):
        with pytest.raises(ValueError, match="out of range"):
            DPAdamW(p, **kwargs)


def test_a_private_run_trains_with_dp_adamw_and_gets_the_mechanisms_noise(make_cfg, monkeypatch):
    from workbench import train

    made = []
    original_init = DPAdamW.__init__

    @functools.wraps(original_init)  # the job reads the signature to decide whether to pass noise_std
    def spy(self, *args, **kwargs):
        made.append(kwargs.get("noise_std"))
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(DPAdamW, "__init__", spy)
    result = train(make_cfg("experiment=quick", "optimizer=dp_adamw", "learning_rate=1e-3", "max_steps=20",
                            "privacy.secure_seed=1", "tracking.enabled=false"))
    assert len(made) == 1
    assert made[0] == pytest.approx(result.noise_multiplier * 1.0 / 64, rel=1e-12)  # sigma C / B, C = 1, B = 64
    assert result.history.loss[-1] < result.history.loss[0] / 10 and result.metrics["eval_accuracy"] > 0.9


def test_dp_adamw_without_privacy_is_refused_in_one_line(make_cfg):
    from workbench import train

    with pytest.raises(WorkbenchError, match="needs privacy") as e:
        train(make_cfg("experiment=quick", "optimizer=dp_adamw", "privacy=none", "tracking.enabled=false"))
    assert "\n" not in str(e.value)
    with pytest.raises(WorkbenchError, match="set from the run's mechanism"):
        train(make_cfg("experiment=quick", "optimizer=dp_adamw", "+optimizer.noise_std=0.1", "tracking.enabled=false"))


def test_a_changing_noise_std_is_corrected_by_the_average_variance_in_v():
    """Adaptive clipping moves s_t = sigma_g C_t / B every step: v holds the EMA of g~^2, whose noise share is the EMA
    of s_t^2, and that (bias-corrected with v) is what is subtracted; a constant s gives back the paper's s^2."""
    lr, b1, b2, eps, gamma = 0.1, 0.9, 0.99, 1e-8, 1e-6
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    opt = DPAdamW([p], lr=lr, betas=(b1, b2), eps=eps, noise_std=0.0, gamma=gamma)
    theta, m, v, n = [1.0, -2.0], [0.0] * 2, [0.0] * 2, 0.0
    for t, (g, s) in enumerate(zip([[0.8, -0.1], [1.2, 0.05], [0.3, 0.4]], [0.5, 0.2, 0.05]), start=1):
        opt.param_groups[0]["noise_std"] = s  # as the trainer sets it each step
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        n = b2 * n + (1 - b2) * s * s
        for i in range(2):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            theta[i] -= lr * (m[i] / (1 - b1 ** t)) / (math.sqrt(max((v[i] - n) / (1 - b2 ** t), gamma)) + eps)
    assert p.detach().tolist() == pytest.approx(theta, rel=1e-12)


def test_dp_adamw_under_adaptive_clipping_is_told_each_steps_noise(make_cfg, monkeypatch):
    """The update's noise std is sigma_g C_t / B with C_t the C the step clipped at: the optimizer gets that at every
    step, not sigma C_0 / B."""
    from workbench import train
    from workbench.privacy.clipping.adaptive import AdaptiveClip

    told, clips = [], []
    step, update = DPAdamW.step, AdaptiveClip.update
    monkeypatch.setattr(DPAdamW, "step", lambda self, *a: (told.append(self.param_groups[0]["noise_std"]), step(self, *a))[1])
    monkeypatch.setattr(AdaptiveClip, "update", lambda self, *a: (clips.append(self.value), update(self, *a))[1])
    result = train(make_cfg("experiment=quick", "optimizer=dp_adamw", "privacy.clipping=adaptive", "max_steps=12",
                            "privacy.clip_learning_rate=0.5", "tracking.enabled=false"))
    batch, sigma_b = 64, 64 / 20  # the count's noise: B / 20 by default (Andrew et al.)
    sigma_g = (result.noise_multiplier ** -2 - (2 * sigma_b) ** -2) ** -0.5  # the paper's split of the noise
    assert len(told) == len(clips) == 12 and len(set(clips)) > 1  # C moved
    assert told == pytest.approx([sigma_g * c / batch for c in clips], rel=1e-12)

