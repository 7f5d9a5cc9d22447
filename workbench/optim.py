"""Optimizers that know the run's noise: post-processing of the released (noised, averaged) update, no privacy cost.

:class:`DPAdamW` is DP-AdamBC (Tang, Panda, Aumuller & Jiang, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You
Apply Bias Correction)", AAAI 2024) with AdamW's decoupled weight decay. The update the optimizer sees is
g~ = g + z, z ~ N(0, s^2) per coordinate with s = sigma C / B (the noise sigma C added once to the clipped sum, divided
by the expected batch B). So E[g~^2] = g^2 + s^2: Adam's second moment is dominated by the noise, every coordinate
gets about the same step size lr / s and "DP-Adam is DP-SGD". The correction subtracts the known s^2 from the
bias-corrected second moment, floored at gamma:

    m_t = beta1 m + (1 - beta1) g~            m^ = m_t / (1 - beta1^t)
    v_t = beta2 v + (1 - beta2) g~^2          v^ = v_t / (1 - beta2^t)
    theta <- theta (1 - lr weight_decay)                              (decoupled, as torch.optim.AdamW)
    theta <- theta - lr m^ / (sqrt(max(v^ - s^2, gamma)) + eps)

When s changes from step to step (adaptive clipping: s_t = sigma_g C_t / B, C_t moving), v_t holds an average of the
past steps' noise variances, not s_t^2: the correction subtracts that same average, n_t = beta2 n + (1 - beta2) s_t^2
(bias-corrected with v), which is s^2 exactly when s is constant. The trainer sets each step's s (``noise_std``).

What is implemented beside the paper's update: the floor gamma (default 5e-8, a small constant as in the paper, tune it
with the learning rate) and AdamW's eps kept in the denominator (default 1e-8), so that with s = 0 and gamma = 0 the
update is torch.optim.AdamW's, bit for bit (the tests check it). Everything it reads was released: the noised update
and (sigma, C, B), which are public. The job passes ``noise_std`` = sigma C / B from the run's Mechanism
(workbench/job.py); it is refused without privacy.
"""

from __future__ import annotations

import torch


class DPAdamW(torch.optim.Optimizer):
    """AdamW whose second moment subtracts the noise's known variance ``noise_std**2`` (DP-AdamBC; module docstring).

    Args:
        params: the trainable parameters.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (``weight_decay`` is decoupled).
        noise_std: s = sigma C / B, the std of the noise in each coordinate of the update the optimizer receives.
        gamma: the floor of the corrected second moment (after bias correction).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, noise_std: float = 0.0, gamma: float = 5e-8):
        for name, value, ok in (("lr", lr, lr >= 0), ("eps", eps, eps >= 0), ("weight_decay", weight_decay, weight_decay >= 0),
                                ("noise_std", noise_std, noise_std >= 0), ("gamma", gamma, gamma >= 0),
                                ("betas", betas, len(betas) == 2 and all(0 <= b < 1 for b in betas))):
            if not ok:
                raise ValueError(f"DPAdamW: {name}={value!r} is out of range")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      noise_std=float(noise_std), gamma=gamma))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            noise_var, gamma = group["noise_std"] ** 2, group["gamma"]  # this step's s^2
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"].item()
                exp_avg, exp_avg_sq, grad = state["exp_avg"], state["exp_avg_sq"], p.grad
                p.mul_(1 - lr * group["weight_decay"])
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
                # n_t, v's share of noise variance (a float: no device read); a state saved without it had a constant s
                noise_sq = state.get("noise_sq", noise_var * (1 - beta2 ** (t - 1)))
                state["noise_sq"] = noise_sq = beta2 * noise_sq + (1 - beta2) * noise_var  # = s^2 bc2 for a constant s
                # max(v / bc2 - n / bc2, gamma) = max(v - n, gamma bc2) / bc2: torch.optim.AdamW's arithmetic at s = 0
                corrected = (exp_avg_sq - noise_sq).clamp_(min=gamma * bc2)
                denom = (corrected.sqrt_() / bc2 ** 0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / bc1)
        return loss
