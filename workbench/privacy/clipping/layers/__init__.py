"""Book-keeping's per-layer rules: from a layer's input ``a`` and output gradient ``g`` (batch first), each call's
part of the per-sample squared gradient norms and of the clipped sum.

Book-keeping hands a rule each call's (a, g) during the backward, as g arrives. The rule takes one of two routes:
- per-sample gradients (``keeps`` false): ``per_sample(m, a, g)`` forms them at once, (n, *shape) per parameter, and
  a and g are let go; the norms are theirs, the clipped sum one matrix-vector product. Taken where they are no larger
  than a and g (convolutions, normalisation affine parameters; Linear sequences up to ``LinearRule.FORM_IF`` times
  larger): memory near a non-private step's, and the clipped sum costs no second weight-gradient kernel.
- kept calls (``keeps`` true): (a, g) are held until the clip factors are known, then
  ``prepare(m, calls, n)``              what the two steps below share (e.g. the calls joined), computed once;
  ``bound(m, state, n, batch)``         a :class:`~workbench.privacy.clipping.bound.Bound` per example: a certified upper
                                        bound on the norm of what ``add_clipped`` will add for it (the argument is in
                                        :mod:`workbench.privacy.clipping.bound`), never a float estimate of it;
  ``add_clipped(m, state, f, view_of)`` sum_i f_i grad_i into each trainable parameter's buffer view.
  Taken where per-sample gradients would be larger (one row per example through a Linear, embeddings, wide layers).
``sample(m, calls, k, absolute)`` is the pre-run check's independent route: example k's own gradient per parameter name
(``absolute``: the same sum over |terms|, the check's rounding scale).
Only parameters with ``requires_grad`` are clipped (a frozen bias or base weight is skipped). Rules work in float32 at
least: under bf16/fp16 autocast a and g arrive in half precision, and norms, clip factors and the clipped sum must not
round there; the sum is cast to the buffer's dtype only when added.

One module per layer family, the registry (which rule clips which layer) here: linear.py (nn.Linear, q/k/v joined,
Hugging Face's Conv1D), embedding.py, conv.py (nn.Conv1d/2d), patch_conv.py (a ViT's patch embedding), norms.py
(LayerNorm, RMSNorm, GroupNorm); common.py what they share (trainable parameters, float32 at least, the clipped-sum
kernels' chunks and rounding depth).
"""

from __future__ import annotations

from torch import nn

from workbench.privacy.clipping.layers.common import (KERNEL_ROWS, PER_SAMPLE_IF, Calls, kernel_depth, per_call,
                                                      precise, smaller_kept, trainable, weighted_sum)
from workbench.privacy.clipping.layers.conv import ConvRule
from workbench.privacy.clipping.layers.embedding import EmbeddingRule
from workbench.privacy.clipping.layers.linear import Conv1DRule, JoinedLinearRule, JoinedLinears, LinearRule
from workbench.privacy.clipping.layers.norms import GroupNormRule, LayerNormRule, Materialised
from workbench.privacy.clipping.layers.patch_conv import PatchConvRule

__all__ = ["CONV1D", "KERNEL_ROWS", "PARAMETERS", "PATCH_CONV", "PER_SAMPLE_IF", "RULES", "Calls", "Conv1DRule",
           "ConvRule", "EmbeddingRule", "GroupNormRule", "JoinedLinearRule", "JoinedLinears", "LayerNormRule",
           "LinearRule", "Materialised", "PatchConvRule", "_precise", "kernel_depth", "per_call", "precise",
           "rule_for", "smaller_kept", "trainable", "weighted_sum"]
_precise = precise  # its name before the split (book_keeping imported it from here)


def _hf_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D itself (not a subclass), recognised without importing transformers (an optional extra)."""
    return type(m).__name__ == "Conv1D" and type(m).__module__ == "transformers.pytorch_utils"


RULES: dict[type, object] = {nn.Linear: LinearRule(), nn.Embedding: EmbeddingRule(), nn.Conv1d: ConvRule(),
                             nn.Conv2d: ConvRule(), nn.LayerNorm: LayerNormRule(), nn.RMSNorm: LayerNormRule(),
                             nn.GroupNorm: GroupNormRule()}
CONV1D = Conv1DRule()
PATCH_CONV = PatchConvRule()  # picked by rule_for for the convolutions it applies to
PARAMETERS = {nn.Linear: {"weight", "bias"}, nn.Embedding: {"weight"}, nn.Conv1d: {"weight", "bias"},
              nn.Conv2d: {"weight", "bias"}, nn.LayerNorm: {"weight", "bias"}, nn.RMSNorm: {"weight"},
              nn.GroupNorm: {"weight", "bias"}}


def rule_for(m: nn.Module) -> tuple[object | None, str | None]:
    """(the rule, None), or (None, why book-keeping cannot clip this layer)."""
    name = type(m).__name__
    if _hf_conv1d(m):
        if {n for n, _ in m.named_parameters(recurse=False)} - {"weight", "bias"} or m._forward_pre_hooks:
            return None, f"cannot see how {name}'s weight is computed (extra parameters or pre-hooks)"
        return CONV1D, None
    base = next((t for t in RULES if type(m).forward is t.forward and isinstance(m, t)), None)
    if base is None:  # a subclass that computes otherwise (a LoRA-merged weight, scaled weights...), or no rule
        return None, f"has no rule for {name}"
    if {n for n, _ in m.named_parameters(recurse=False)} - PARAMETERS[base] or m._forward_pre_hooks:
        return None, f"cannot see how {name}'s weight is computed (extra parameters or pre-hooks)"
    if base is nn.Embedding and (m.max_norm is not None or m.scale_grad_by_freq):
        return None, "cannot clip nn.Embedding with max_norm (renormalises the weight in place) or " \
                     "scale_grad_by_freq (scales by counts over the whole batch: examples mix)"
    if base in (nn.Conv1d, nn.Conv2d) and PatchConvRule.applies(m):
        return PATCH_CONV, None
    return RULES[base], None
