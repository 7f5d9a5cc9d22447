"""Opacus' per-sample gradient modes.

- ``hooks``, ``functorch``, ``ew`` (torch's expanded weights): per-sample gradients are materialised in
  ``p.grad_sample``; their flat norms give the clip factors and one ``addmv_`` per parameter the clipped sum.
- ``ghost`` (fast gradient clipping): a first backward yields per-sample norms without materialising per-sample
  gradients, a second backward of the clip-weighted loss yields the clipped sum directly.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.clipping.base import LossFn, Strategy, add_grads, clip_factors
from workbench.errors import WorkbenchError


class _OpacusStrategy(Strategy):
    params: list[nn.Parameter]

    def _per_example(self, p: nn.Parameter, per_sample: torch.Tensor, n: int) -> torch.Tensor:
        """Opacus sums over the batch, without a word, a layer whose input has no batch dimension: refuse it."""
        if per_sample.shape[0] != n:
            name = next(k for k, q in self.module.named_parameters() if q is p).removeprefix("_module.")
            raise WorkbenchError(f"parameter {name!r} has no per-example gradient (its layer's input is shared by the "
                                 "batch, e.g. position embeddings of shape (1, T)): freeze it, or feed it per-example "
                                 "inputs")
        return per_sample


class PerSampleGradients(_OpacusStrategy):
    def __init__(self, model: nn.Module, params: list[nn.Parameter], clip: float, mode: str):
        from opacus.grad_sample import GradSampleModule, GradSampleModuleExpandedWeights

        self.params, self.clip = params, clip
        if mode == "ew":
            self.module = GradSampleModuleExpandedWeights(model, batch_first=True, loss_reduction="sum")
        else:
            self.module = GradSampleModule(model, batch_first=True, loss_reduction="sum",
                                           force_functorch=mode == "functorch")

    def accumulate(self, batch, loss_fn: LossFn, view_of: dict[int, torch.Tensor]) -> torch.Tensor:
        losses = loss_fn(self.module, batch)
        n = len(losses)
        losses.sum().backward()
        # None: a parameter unused in this forward; its clipped gradient is zero.
        # Norms, factors and the sum in the parameters' dtype (float32), from the very values summed, whatever
        # precision the backward ran in (bf16/fp16 autocast).
        flat_samples = [(view_of[id(p)], self._per_example(p, p.grad_sample, n).reshape(n, -1).to(view_of[id(p)].dtype))
                        for p in self.params if p.grad_sample is not None]
        norms = torch.zeros(n, device=losses.device)
        if flat_samples:  # vector_norm and addmv_: no full-size temporaries of the per-sample gradients
            norms = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(gs, dim=1) for _, gs in flat_samples], dim=1), dim=1)
        factor = clip_factors(norms, self.clip)
        for view, gs in flat_samples:
            view.view(-1).addmv_(gs.t(), factor.to(gs.dtype))
        for p in self.params:
            p.grad_sample = None
            p.grad = None
        return losses.detach()


class Ghost(_OpacusStrategy):
    def __init__(self, model: nn.Module, params: list[nn.Parameter], clip: float):
        from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping

        self.params, self.clip = params, clip
        self.module = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="sum",
                                                           max_grad_norm=clip, use_ghost_clipping=True)

    def accumulate(self, batch, loss_fn: LossFn, view_of: dict[int, torch.Tensor]) -> torch.Tensor:
        losses = loss_fn(self.module, batch)
        losses.sum().backward(retain_graph=True)
        norms = torch.zeros(len(losses), device=losses.device)
        for p in self.params:
            ns = getattr(p, "_norm_sample", None)
            if ns is not None:
                norms.add_(self._per_example(p, ns, len(losses)).pow(2))
                p._norm_sample = None
            p.grad = None
        factor = clip_factors(norms.sqrt_(), self.clip)
        self.module.disable_hooks()
        try:
            (factor.detach() * losses).sum().backward()
        finally:
            self.module.enable_hooks()
        add_grads(self.params, view_of)
        return losses.detach()
