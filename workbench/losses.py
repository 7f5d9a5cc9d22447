"""The public path of workbench/models/losses.py (``workbench.losses.TokenCrossEntropy`` is what configs name), kept
as re-exports. New code imports workbench.models.losses."""

from workbench.models.losses import TokenCrossEntropy, logits_of

__all__ = ["TokenCrossEntropy", "logits_of"]
