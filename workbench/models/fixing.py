"""The model DP-SGD trains (``privacy.fix_model``): layers whose per-example gradients no clipping route can form are
swapped for their DP equivalents (Opacus' ModuleValidator.fix, BatchNorm for a per-example GroupNorm), or the model is
refused in one line. A model that book-keeping clipping covers layer by layer is trained as it is."""

from __future__ import annotations

import functools
import math

from torch import nn

from workbench.errors import WorkbenchError


def prepare_model(model: nn.Module, private: bool, fix: bool = True) -> tuple[nn.Module, list[str]]:
    """The model DP-SGD will train, and what was replaced to get it.

    Layers whose per-sample gradients Opacus cannot compute are swapped for their DP equivalents when ``fix``
    (nn.MultiheadAttention -> :class:`workbench.models.attention.PerExampleMultiheadAttention`, the same function from
    nn.Linear layers; then Opacus' ``ModuleValidator.fix``: LSTM/GRU/RNN -> DPLSTM/DPGRU/DPRNN
    with their weights, BatchNorm -> a per-example GroupNorm (:func:`per_example_norm`), freshly initialised since no
    weights make them equal); without ``fix``,
    or when a layer has no replacement, the model is refused in one line.
    """
    if isinstance(model, nn.DataParallel):
        raise WorkbenchError("torch.nn.DataParallel is refused: use launcher=local (one process per device) instead")
    if not private:
        return model, []
    from workbench.models import attention
    from workbench.privacy.clipping import book_keeping

    swapped = attention.replace(model) if fix else []  # nn.MultiheadAttention: the same function from nn.Linears
    layers = book_keeping.trainable_layers(model)
    if layers and book_keeping.refusal(layers) is None:
        return model, swapped  # bk has a rule for every trainable layer; each mode's pre-run check refuses what mixes
    was_training = model.training
    model.train()  # the mode it trains in (Opacus refuses a model in eval mode); handed back as it came
    try:
        model, fixed = _fix(model, fix)
        return model, swapped + fixed
    finally:
        model.train(was_training)


def _fix(model: nn.Module, fix: bool) -> tuple[nn.Module, list[str]]:
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors and fix:
        before = {name: type(m).__name__ for name, m in model.named_modules()}
        _replace_batch_norms(model)
        model = ModuleValidator.fix(model)
        replaced = [(name, before[name], m) for name, m in model.named_modules()
                    if name in before and before[name] != type(m).__name__]
        for _, _, m in replaced:
            _batch_first_attention_fix(m)
        outer = [name for name, _, _ in replaced]  # a replaced layer's own sub-layers are not news
        replaced = [r for r in replaced if not any(r[0].startswith(f"{o}.") for o in outer if o)]
        errors = ModuleValidator.validate(model, strict=False)
        notes = [f"{name or 'model'}: {old} -> {type(m).__name__}"
                 + (" (re-initialised)" if "Norm" in old else " (weights carried)") for name, old, m in replaced]
        if not errors:
            return model, notes
    if errors:
        from workbench.model_checks import batch_norm_refusal

        mixing = batch_norm_refusal(model)
        if mixing:
            raise WorkbenchError(mixing)
        first = str(errors[0]).splitlines()[0]
        hint = " (privacy.fix_model=true replaces it with a DP equivalent)" if not fix else ""
        raise WorkbenchError(f"the model has {len(errors)} layer(s) DP-SGD cannot handle: {first}{hint}")
    return model, []


def per_example_norm(bn: nn.modules.batchnorm._BatchNorm) -> nn.GroupNorm:
    """BatchNorm's stand-in that normalises each example on its own. Opacus' default, GroupNorm(gcd(32, C), C),
    leaves a BatchNorm1d over C <= 32 features with one value per group, which it normalises to 0 (a model that cannot
    learn). Features (BatchNorm1d on (N, C) or (N, C, L)) are normalised across all C features (one group: LayerNorm's
    statistics, BatchNorm's per-feature scale and shift); images and volumes (2d, 3d) in Wu & He's groups of channels,
    which hold C/G x H x W values each. A group that still holds one value is refused by the pre-run check."""
    c = bn.num_features
    groups = 1 if isinstance(bn, nn.BatchNorm1d) else math.gcd(32, c)
    return nn.GroupNorm(groups, c, eps=bn.eps, affine=bn.affine)


def _replace_batch_norms(model: nn.Module) -> None:
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                setattr(module, child_name, per_example_norm(child))


def _reorder_heads(num_heads: int, module: nn.Module, args: tuple) -> tuple:
    """(batch * heads, T, head_dim) laid out as (batch, T, embed): put each position's heads back together."""
    (x,) = args
    b, t, e = x.shape
    return (x.reshape(b, num_heads, t, e // num_heads).transpose(1, 2).reshape(b, t, e),)


def _batch_first_attention_fix(module: nn.Module) -> None:
    """Opacus 1.6's DPMultiheadAttention with batch_first=True reshapes its heads' output into (batch, T, embed)
    without transposing, mixing positions within each example (not across examples): its output differs from
    nn.MultiheadAttention's with the same weights. A pre-hook on its out_proj restores the right layout; the
    per-sample gradient hooks see the corrected input."""
    from opacus.layers import DPMultiheadAttention

    if isinstance(module, DPMultiheadAttention) and module.batch_first:
        module.out_proj.register_forward_pre_hook(functools.partial(_reorder_heads, module.num_heads))
