"""Per-sample clipping: one strategy per ``grad_sample_mode``, one module each.

- ``book_keeping`` (``bk``): one backward, closed-form per-sample norms, the clipped sum as one matmul per layer;
  ``rows``: its lean path where every trainable layer is an nn.Linear on float32 rows (the same computation);
- ``opacus_modes``: Opacus' ``hooks``, ``functorch``, ``ew`` (materialised per-sample gradients; ``ghost`` refused);
- ``whole_model``: ``vmap``, per-example gradients of the whole model by torch.func (any model vmap can batch);
- ``bound``: the floating-point bound every private route honours (each example's contribution <= C (1 + RHO));
- ``nonprivate``: the non-private twin (plain summed gradients through the same buffer).

:func:`make` returns a strategy (interface in :mod:`workbench.privacy.clipping.base`); ``auto`` picks the fastest that fits.
"""

from __future__ import annotations

from torch import nn

from workbench.privacy.clipping import book_keeping
from workbench.privacy.clipping.base import LossFn
from workbench.errors import WorkbenchError

__all__ = ["LossFn", "auto_note", "candidate_modes", "fastest_grad_sample_mode", "make", "ruled_out"]

# Layers torch's expanded weights (grad_sample_mode=ew) computes per-sample gradients for.
_EW_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.GroupNorm, nn.LayerNorm,
              nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def fastest_grad_sample_mode(model: nn.Module) -> str:
    """What grad_sample_mode=auto picks, by benchmarks/RESULTS.md: book-keeping where it has a rule for every trainable
    layer (one backward, per-sample gradients never materialised), expanded weights where that covers every layer,
    else Opacus' hooks. Every mode's pre-run check still runs: a model that breaks bk's assumptions is refused."""
    layers = book_keeping.trainable_layers(model)
    if layers and book_keeping.refusal(layers) is None:
        return "bk"
    if layers and all(type(m) in _EW_LAYERS for m in layers):  # exact types: a subclass may compute otherwise
        return "ew"
    return "hooks"


def candidate_modes(model: nn.Module, mixed_precision: bool = False) -> list[str]:
    """What grad_sample_mode=auto tries, fastest first: the modes whose layer-level conditions hold, then ``vmap``
    (per-example gradients of the whole model by torch.func, :mod:`workbench.privacy.clipping.whole_model`), the
    universal route. GradientStep takes the first whose pre-run check passes on real examples."""
    first = fastest_grad_sample_mode(model)
    layers = book_keeping.trainable_layers(model)
    if first == "bk" and book_keeping.refusal(layers, raw=False) is not None:
        # bk only by raw parameters (a cls token, a position table): the other modes as the layers alone allow
        first = "ew" if all(type(m) in _EW_LAYERS for m in layers) else "hooks"
        return ["bk", *[m for m in ["ew", "hooks"][["ew", "hooks"].index(first):]
                       if not (mixed_precision and m == "ew")], "vmap"]
    modes = ["bk", "ew", "hooks"][["bk", "ew", "hooks"].index(first):]
    if mixed_precision:  # ew's clipped sum cannot run in mixed precision (GradientStep refuses it)
        modes = [m for m in modes if m != "ew"]
    return [*modes, "vmap"]


def ruled_out(model: nn.Module, mixed_precision: bool = False) -> list[tuple[str, str]]:
    """The faster modes :func:`candidate_modes` leaves out for this model, each with why (auto's note says both)."""
    modes = candidate_modes(model, mixed_precision)
    layers = book_keeping.trainable_layers(model)
    out = []
    if "bk" not in modes:
        out.append(("bk", book_keeping.refusal(layers) or "no trainable layer"))
    if "ew" not in modes:
        out.append(("ew", "mixed precision (its clipped sum is not computed from the per-sample gradients its norms "
                          "were)" if mixed_precision else "a trainable layer torch's expanded weights has no rule for: "
                    + ", ".join(sorted({type(m).__name__ for m in layers if type(m) not in _EW_LAYERS}))))
    return out


def auto_note(mode: str, skipped: list[tuple[str, str]]) -> str:
    """auto's one line: the mode it took and why each faster one was skipped (one reason, every mode it ruled out)."""
    order = ["bk", "ew", "hooks", "vmap"]  # fastest first, as auto tries them
    said: dict[str, list[str]] = {}
    for m, reason in sorted(skipped, key=lambda s: order.index(s[0])):
        if order.index(m) < order.index(mode):  # a slower mode left out is not why this one was taken
            said.setdefault(reason, []).append(m)
    why = "; ".join(f"{', '.join(modes)} skipped: {reason}" for reason, modes in said.items())
    return f"grad_sample_mode=auto: {mode}" + (f" ({why})" if why else "")


def make(model: nn.Module, params: list[nn.Parameter], *, max_grad_norm: float | None, mode: str):
    """The strategy for ``mode`` (not ``auto``: see :func:`fastest_grad_sample_mode`); ``max_grad_norm=None`` gives
    the non-private twin."""
    if max_grad_norm is None:
        from workbench.privacy.clipping.nonprivate import Summed

        return Summed(model, params)
    if mode == "bk":
        return book_keeping.BookKeeping(model, max_grad_norm)
    if mode == "vmap":
        from workbench.privacy.clipping.whole_model import WholeModel

        return WholeModel(model, params, max_grad_norm)
    from workbench.privacy.clipping import opacus_modes

    if mode == "ghost":
        raise WorkbenchError(opacus_modes.GHOST_REFUSAL)
    return opacus_modes.PerSampleGradients(model, params, max_grad_norm, mode)
