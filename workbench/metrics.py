"""Evaluation payloads and the default metric, with Hugging Face's ``EvalPrediction`` shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class EvalPrediction:
    """What ``compute_metrics`` receives: the cluster-wide predictions and labels, in dataset order."""

    predictions: Any
    label_ids: Any


def accuracy(pred: EvalPrediction) -> dict[str, float]:
    predictions = np.asarray(pred.predictions)
    labels = np.asarray(pred.label_ids)
    if len(labels) == 0:
        return {"accuracy": float("nan")}
    return {"accuracy": float((predictions.argmax(-1) == labels).mean())}
