"""Cluster-wide evaluation: each rank predicts its contiguous shard of the eval set, ranks gather in dataset order,
and the metrics see the whole set (non-private: the eval set is not the training data)."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from workbench.data.batches import Batch, as_batch
from workbench.distributed import Dist, pad_concat
from workbench.models.losses import logits_of


class Evaluator:
    """Cluster-wide eval: each rank predicts its contiguous shard, ranks gather in order, metrics see the whole set."""

    def __init__(self, model: nn.Module, criterion: nn.Module, loader, dist: Dist,
                 compute_metrics: Callable | None, use_gather_object: bool = False, batch_eval_metrics: bool = False,
                 autocast_dtype: torch.dtype | None = None):
        self.model, self.criterion, self.loader, self.dist = model, criterion, loader, dist
        self.compute_metrics, self.force_object, self.batched = compute_metrics, use_gather_object, batch_eval_metrics
        self.autocast_dtype = autocast_dtype

    def _gather(self, predictions, labels):
        from workbench.metrics import EvalPrediction

        return EvalPrediction(self.dist.gather_payload(predictions, self.force_object),
                              self.dist.gather_payload(labels, self.force_object))

    def _predict(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, per-example losses), both float32."""
        with torch.autocast(self.dist.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = logits_of(batch.forward(self.model))
            return out.float(), self.criterion(out, batch.labels).float()

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        totals = torch.zeros(2, device=self.dist.device)  # loss sum, example count
        predictions, labels, metrics = [], [], {}
        batches = iter(self.loader)  # streamed: the eval set is never held twice
        n_batches = max(self.dist.all_gather_object(len(self.loader))) if self.batched else len(self.loader)
        for i in range(n_batches):
            batch = as_batch(next(batches, None))
            if batch is not None and len(batch):
                batch = batch.to(self.dist.device, non_blocking=True)
                out, losses = self._predict(batch)
                totals[0] += losses.sum()
                totals[1] += len(batch)
                out, y = out.cpu(), batch.labels.cpu()
            else:  # this rank's shard has fewer eval batches: it joins the gather with an empty payload
                out, y = torch.empty(0), torch.empty(0, dtype=torch.long)
            if self.compute_metrics is None:
                continue
            if self.batched:
                metrics = self.compute_metrics(self._gather(out, y), compute_result=i == n_batches - 1)
            elif len(y):
                predictions.append(out)
                labels.append(y)
        if not self.batched and self.compute_metrics is not None:
            metrics = self.compute_metrics(self._gather(pad_concat(predictions, torch.empty(0)),
                                                        pad_concat(labels, torch.empty(0, dtype=torch.long))))
        self.dist.all_reduce_(totals)
        self.model.train(was_training)
        out = {f"eval_{k}": float(v) for k, v in (metrics or {}).items()}
        out["eval_loss"] = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
        if getattr(self.criterion, "reports_perplexity", False):
            out["eval_perplexity"] = math.exp(min(out["eval_loss"], 700.0))
        return out
