"""Why a model fails, said about the model: the module that raised, a layer that mixes examples across the batch, a
weight fed with no batch dimension, an output DP-SGD cannot read. The data check (workbench/data/checks.py) and the
pre-run check of the clipping strategy (workbench/step.py) use it so that a refusal names the real cause, with the
module path, and never blames the data when the data is fine.

Everything here runs the model on the examples the checks already read, before training; it releases nothing.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from workbench.errors import WorkbenchError

# Errors torch raises when a tensor has the wrong shape or dtype for a layer (not a model's own refusal).
SHAPE_ERROR = re.compile(
    r"shape|size|dimension|mat1|mat2|channels|must match|dtype|scalar type|index out of range|out of bounds|"
    r"expected .*input|expected .*\d-?d|unflatten|cannot be multiplied|batch1|batch2|invalid for input", re.I)

# the fix a shared-input refusal offers a per-layer mode; auto has already tried it (step.py drops it there)
AUTO_FIX = "use grad_sample_mode=auto (it falls back to per-example gradients of the whole model) or "


def one_line(e: BaseException) -> str:
    """An exception a library raised, in one line (a repr's escaped newlines too): auto's reason to skip a mode."""
    return f"{type(e).__name__}: {' '.join(str(e).replace(chr(92) + 'n', ' ').split())}"


def fails_alone(losses: Callable[[], torch.Tensor], params: list[nn.Parameter]) -> bool:
    """Whether the bare model's forward (``losses()``) and backward fail with no clipping mode around it: then the
    failure is the model's or the data's, and no other mode helps. Gradients are taken, never accumulated, and the
    random state is restored (dropout's draws here must not shift training's)."""
    cuda = [params[0].device] if params[0].device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            torch.autograd.grad(losses().sum(), params, allow_unused=True)
    except Exception:  # noqa: BLE001 - any failure of the bare model is its own
        return True
    return False


def path(name: str) -> str:
    return f"model.{name}" if name else "model"


def reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300] or '(no message)'}"


@dataclass
class Failure:
    """Where a forward raised: the innermost module running (its path and type), its tensor inputs, the error."""

    name: str
    module: nn.Module
    inputs: list[torch.Tensor]
    error: BaseException

    @property
    def where(self) -> str:
        return f"{path(self.name)} ({type(self.module).__name__})"

    def is_shape_error(self) -> bool:
        return isinstance(self.error, (RuntimeError, IndexError, ValueError)) and bool(SHAPE_ERROR.search(str(self.error)))


def _tensors(args: tuple, kwargs: dict | None = None) -> list[torch.Tensor]:
    out = []
    for v in [*args, *(kwargs or {}).values()]:
        if torch.is_tensor(v):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out += [t for t in v if torch.is_tensor(t)]
    return out


@contextlib.contextmanager
def _stack(model: nn.Module) -> Iterator[list]:
    """While in the block: the modules running now, outermost first (a raise leaves the innermost on top)."""
    running: list = []

    def push(name, m, args, kwargs):
        running.append((name, m, _tensors(args, kwargs)))

    def pop(m, args, kwargs, out):
        if running and running[-1][1] is m:
            running.pop()

    handles = []
    for name, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(lambda m, a, k, name=name: push(name, m, a, k), with_kwargs=True))
        handles.append(m.register_forward_hook(pop, with_kwargs=True))
    try:
        yield running
    finally:
        for h in handles:
            h.remove()


def forward(model: nn.Module, run: Callable[[], Any]) -> tuple[Any, Failure | None]:
    """Run ``run()`` (a forward of ``model``): (its output, None), or (None, where and why it raised)."""
    with _stack(model) as running:
        try:
            return run(), None
        except WorkbenchError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's model: any error is described, not re-raised raw
            name, m, inputs = running[-1] if running else ("", model, [])
            return None, Failure(name, m, inputs, e)


def model_error(f: Failure, data_shape: tuple, name: str) -> str:
    """A model that raised on an input whose shape its first layers took: the model's error, not the data's."""
    return (f"the model raised in {f.where} on {name}'s examples (shape {data_shape} per example, which its earlier "
            f"layers took): {reason(f.error)}; this is the model's own error, not the data's: fix {path(f.name)} "
            "(or the arguments its caller passes it) so that the model runs on these inputs outside the workbench")


def inner_shape_error(f: Failure, data_shape: tuple, name: str) -> str:
    """A layer deep in the model that cannot take what the layers before it give it."""
    got = f.inputs[0] if f.inputs else None
    shape = tuple(got.shape[1:]) if got is not None and got.dim() > 0 else None
    hint = ""
    if isinstance(f.module, nn.Linear) and shape:
        hint = f" (e.g. in_features={shape[-1]})"
    elif isinstance(f.module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and shape:
        hint = f" (e.g. in_channels={shape[0]})"
    return (f"{f.where} cannot take what the layers before it give it "
            f"({'shape ' + str(shape) + ' per example' if shape is not None else 'its input'}; {name}'s examples of "
            f"shape {data_shape} reach it through the model's earlier layers): {reason(f.error)}; make {path(f.name)} "
            f"take inputs of shape {shape} per example{hint}, or give the model inputs of the shape it was built for")


def batch_only_error(f: Failure, n: int) -> str:
    return (f"the model fails on a batch of {n} examples but runs on each example alone: {f.where} raised "
            f"{reason(f.error)}; DP-SGD needs each example's output to depend on that example alone: make "
            f"{path(f.name)} keep the batch as dim 0 and work for any batch size")


def output_tensor(out: Any, n: int, model: nn.Module | None = None, run: Callable[[], Any] | None = None) -> torch.Tensor:
    """The tensor a criterion reads from the model's output (the output, its ``.logits``, or a tuple's first), with
    one row per example; else one line on what the model returned. ``run`` re-runs the forward to find the module
    that lost the batch."""
    if torch.is_tensor(out):
        tensor = out
    elif torch.is_tensor(getattr(out, "logits", None)):
        tensor = out.logits
    elif isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        tensor = out[0]
    else:
        what = "None (does its forward miss a `return`?)" if out is None else (
            f"a {type(out).__name__}" + (f" with keys {sorted(map(str, out))[:6]}" if isinstance(out, dict) else ""))
        raise WorkbenchError(f"the model returned {what}: nothing a loss can read; its forward must return the output "
                             "tensor (one row per example), a tuple whose first item is it, or an object with .logits "
                             "(a Hugging Face ModelOutput)")
    if tensor.dim() == 0 or tensor.shape[0] != n:
        lost = _lost_batch(model, run, n) if model is not None and run is not None else None
        raise WorkbenchError(f"the model's output has shape {tuple(tensor.shape)} for a batch of {n} examples: it must "
                             "have one row per example (the batch as dim 0)"
                             + (f"; {lost} gets the batch and drops it: keep dim 0 as the batch there" if lost else
                                "; keep dim 0 as the batch through the model (no flattening or reduction over it)"))
    return tensor


def _lost_batch(model: nn.Module, run: Callable[[], Any], n: int) -> str | None:
    seen: list[tuple[str, nn.Module, bool, bool]] = []

    def hook(name, m, args, kwargs, out):
        ins = _tensors(args, kwargs)
        outs = _tensors(out if isinstance(out, tuple) else (out,))
        if ins and outs:
            seen.append((name, m, ins[0].dim() > 0 and ins[0].shape[0] == n,
                         outs[0].dim() > 0 and outs[0].shape[0] == n))

    handles = [m.register_forward_hook(lambda m, a, k, o, name=name: hook(name, m, a, k, o), with_kwargs=True)
               for name, m in model.named_modules() if name]
    try:
        with torch.no_grad():
            run()
    except Exception:  # noqa: BLE001
        return None
    finally:
        for h in handles:
            h.remove()
    return next((f"{path(name)} ({type(m).__name__})" for name, m, kept_in, kept_out in seen if kept_in and not kept_out),
                None)


def batch_norm_refusal(model: nn.Module) -> str | None:
    """The first BatchNorm of the model, refused with its path and the fix (fix_model is off, or it was left in)."""
    name, m = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)),
                   (None, None))
    if m is None:
        return None
    return (f"{path(name)} ({type(m).__name__}) mixes examples across the batch (it normalises with the batch's "
            "statistics), so no example's gradient is its own: privacy.fix_model=true replaces it with a per-example "
            "GroupNorm, or use torch.nn.GroupNorm / LayerNorm in the model")


# --- after the pre-run check found an example's gradient that is not its own: which module is to blame? ---------


def _record(model: nn.Module, run: Callable[[], Any]) -> list[tuple[str, nn.Module, list, list]]:
    """Each module call of one forward, in the order calls end: (name, module, tensor inputs, tensor outputs)."""
    calls: list = []

    def hook(name, m, args, kwargs, out):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        calls.append((name, m, [t.detach() for t in _tensors(args, kwargs)],
                      [t.detach() for t in _tensors(tuple(outs))]))

    handles = [m.register_forward_hook(lambda m, a, k, o, name=name: hook(name, m, a, k, o), with_kwargs=True)
               for name, m in model.named_modules()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return calls


def _rows_agree(big: list, small: list, n: int) -> tuple[bool, bool, bool]:
    """(whether every batch-carrying tensor agrees on the examples both batches hold, whether some tensor ignores the
    batch (the same shape whatever the batch size), whether some tensor carries it)."""
    agree, shared, carried = True, False, False
    for a, b in zip(big, small):
        if not (a.is_floating_point() and b.is_floating_point()) and a.dtype != b.dtype:
            continue
        if a.dim() > 0 and b.dim() > 0 and a.shape[0] == n and b.shape[0] == n - 1 and a.shape[1:] == b.shape[1:]:
            x, y = a[:n - 1], b
            carried = True
            if x.is_floating_point():
                scale = float(x.abs().max()) if x.numel() else 0.0
                agree &= bool(((x.double() - y.double()).abs() <= 1e-4 * scale + 1e-6).all())
            else:
                agree &= bool((x == y).all())
        elif a.shape == b.shape:
            shared = True
    return agree, shared, carried


def explain_not_own(model: nn.Module, forward: Callable[[Any], Any], batch: Any) -> str | None:
    """Why an example's gradient is not its own, found by running ``forward(batch)`` and the same forward without the
    batch's last example (training mode, dropout off): the deepest module whose inputs agree on the shared examples
    but whose outputs do not mixes them; a trainable layer called on an input that ignores the batch size sees no
    examples at all. None when neither shows (a weight used outside its layer, say)."""
    n = len(batch)
    if n < 2:
        return None
    was_training = model.training
    model.train()
    dropouts = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    for m in dropouts:
        m.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            big = _record(model, lambda: forward(batch))
            torch.manual_seed(0)
            small = _record(model, lambda: forward(batch.slice(0, n - 1)))
    except Exception:  # noqa: BLE001 - the diagnosis is best effort; the check's own verdict stands
        return None
    finally:
        model.train(was_training)
    if len(big) != len(small):
        return None
    mixers, shared_layers = [], []
    for (name, m, ins, outs), (_, _, ins2, outs2) in zip(big, small):
        ins_agree, ins_shared, ins_carried = _rows_agree(ins, ins2, n)
        outs_agree, _, _ = _rows_agree(outs, outs2, n)
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if ins_agree and not outs_agree:
            mixers.append((name, m))
        if own and ins_shared and not ins_carried:
            shared_layers.append((name, m, ins[0] if ins else None))
    if shared_layers:
        name, m, x = shared_layers[0]
        shape = tuple(x.shape) if x is not None else ()
        return (f"{path(name)} ({type(m).__name__}) is called on an input of shape {shape} that has no batch dimension "
                "(the same for every example, e.g. position ids torch.arange(T)), so its weight's gradient is summed "
                f"over the batch before a per-layer rule sees it; {AUTO_FIX}give it per-example inputs (e.g. "
                "torch.arange(T).expand(B, T))")
    if mixers:
        deepest = [(name, m) for name, m in mixers
                   if not any(other != name and other.startswith(f"{name}.") or (name == "" and other)
                              for other, _ in mixers)]
        name, m = (deepest or mixers)[0]
        fix = ("replace it with a per-example normalisation (torch.nn.GroupNorm or LayerNorm; privacy.fix_model=true "
               "does this for BatchNorm)" if isinstance(m, nn.modules.batchnorm._BatchNorm) else
               "compute each example's output from that example alone (no mean, sum, sort or attention across dim 0)")
        own = " in its own forward" if list(m.children()) else ""  # the deepest: none of its layers mixes
        return (f"the model mixes examples in {path(name)} ({type(m).__name__}){own}: an example's output changes "
                f"when another example changes, so no gradient is one example's own and per-sample clipping cannot "
                f"apply; {fix}")
    return None
