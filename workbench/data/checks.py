"""The pre-run data check: does each dataset fit the model and the criterion? Run before any MLflow run exists.

A data error found mid-training (or at the closing eval) would surface as a raw RuntimeError deep in torch, with a
run left FAILED. Here it is one line that names the dataset, the example and the fix. What is checked:

- non-finite values: the first SCAN examples of an in-memory tensor dataset (every one up to that size), else the
  first batch (FIRST examples);
- the model takes the first batch (input width, dtype), the criterion takes its output and the labels;
- class labels (a classification criterion, model output ``(batch, classes)``, labels ``(batch,)``) are integers in ``[0, classes)`` (or the
  criterion's ``ignore_index``): the first SCAN labels of an in-memory dataset, else the first batch's.

What it reads is bounded whatever N (a memory-mapped dataset of 1e8 rows: its first FIRST rows); an example past it
that fails is named when its step fails (:func:`blame_example`).

It reads the data the user is about to train on, before training: it releases nothing but the refusal itself.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import nn

from workbench import model_checks
from workbench.data.loaders import examples, first_examples
from workbench.errors import WorkbenchError

FIRST = 8  # examples run through the model and the criterion
SCAN = 1 << 20  # rows of an in-memory tensor dataset scanned for non-finite values and labels (bounded memory)
CLASS_CRITERIA = (nn.CrossEntropyLoss, nn.NLLLoss, nn.MultiMarginLoss)  # take (batch, classes) scores, (batch,) labels


def check_fit(dataset: Any, name: str, model: nn.Module, criterion: Callable, device: torch.device,
              collator: Callable | None = None, indices: list[int] | None = None) -> None:
    """Raise WorkbenchError naming ``name`` (e.g. "data.train (my_pkg.MyData)"), the example index and the fix.
    ``indices``: check these examples (a failed step's batch) instead of the first ones and the in-memory scan."""
    batch = first_examples(dataset, FIRST, collator) if indices is None else examples(dataset, indices, collator)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(torch.is_tensor(t) for t in batch)):
        return  # another batch shape (a mapping, several inputs): checked by the trainer's own pre-run check
    x, y = batch
    tensors = getattr(dataset, "tensors", None)  # TensorDataset: in memory, so scan it (its first SCAN rows)
    whole = indices is None and isinstance(tensors, (tuple, list)) and len(tensors) == 2
    scanned = tuple(t[:SCAN] for t in tensors) if whole else (x, y)
    at = (lambda i: i) if whole or indices is None else indices.__getitem__  # a row of `scanned` -> dataset index
    for what, t in zip(("input", "label"), scanned):
        if t.is_floating_point() and not torch.isfinite(t).all():
            i = int((~torch.isfinite(t.reshape(len(t), -1))).any(dim=1).nonzero()[0])
            raise WorkbenchError(f"{name}: example {at(i)} has a non-finite {what} value "
                                 f"({t[i][~torch.isfinite(t[i])].flatten()[0].item()}); repair or drop it")
    x, y = x.to(device), y.to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), warnings.catch_warnings(), _refuse_lone_values(model):
            warnings.simplefilter("ignore")  # e.g. MSELoss's broadcasting warning: the refusal says it in one line
            out = _model_output(model, x, at, name)
            if isinstance(criterion, CLASS_CRITERIA) and torch.is_tensor(out) and out.dim() == 2 and y.dim() == 1:
                _check_class_labels(scanned[1], out.shape[1], name, getattr(criterion, "ignore_index", None), at)
            shapes = (f"labels {str(y.dtype).replace('torch.', '')} of shape {tuple(y.shape[1:])} per example, model "
                      f"output of shape {tuple(out.shape[1:])}" if torch.is_tensor(out) else "")
            _first_failure(lambda i, j: criterion(out[i:j], y[i:j]), len(x), at, name,
                           f"does not fit the criterion {type(criterion).__name__} ({shapes})",
                           "use a criterion that takes these labels and outputs (class labels: "
                           "torch.nn.CrossEntropyLoss) or labels that fit the criterion")
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _refuse_lone_values(model: nn.Module) -> Iterator[None]:
    """A normalisation whose group holds a single value of each example (GroupNorm(C, C) on (N, C) features, a
    LayerNorm over one value) outputs 0 whatever its input: the model cannot learn. Found on the first batch."""
    def check(name: str, module: nn.Module, args: tuple) -> None:
        x = args[0]
        if isinstance(module, nn.GroupNorm):
            alone = x.dim() >= 2 and x.shape[1] // module.num_groups * math.prod(x.shape[2:]) == 1
        else:
            alone = math.prod(module.normalized_shape) == 1
        if alone:
            c = x.shape[1] if x.dim() >= 2 else 1
            raise WorkbenchError(f"model.{name or 'model'}: {module} normalises each value of its input "
                                 f"{tuple(x.shape)} alone, so its output is always 0 and the model cannot learn; "
                                 f"normalise across the features (torch.nn.GroupNorm(1, {c})) or remove it")

    handles = [m.register_forward_pre_hook(functools.partial(check, n)) for n, m in model.named_modules()
               if isinstance(m, (nn.GroupNorm, nn.LayerNorm))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def blame_example(dataset: Any, indices: list[int], name: str, model: nn.Module, criterion: Callable,
                  device: torch.device, collator: Callable | None = None) -> str | None:
    """After a training step failed on its batch: the first of its examples that is unreadable or fails the pre-run
    check alone, as one line naming its dataset index; None when each passes alone (the failure is not the data's)."""
    for i in indices:
        try:
            check_fit(dataset, name, model, criterion, device, collator, indices=[i])
        except WorkbenchError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - the dataset itself failed to read the example
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            return f"{name}: example {i} cannot be read ({type(e).__name__}: {reason}); repair or drop it"
    return None


def _model_output(model: nn.Module, x: torch.Tensor, at: Callable[[int], int], name: str) -> torch.Tensor:
    """The model's output on the batch x, read as a criterion reads it; else one line that blames what failed: the data
    (the first layer that reads it cannot take its shape), a layer deeper in the model, the model's own error, a
    model that fails only on batches, or an output without one row per example (workbench/model_checks.py)."""
    out, failed = model_checks.forward(model, lambda: model(x))
    if failed is None:
        return model_checks.output_tensor(out, len(x), model, lambda: model(x))
    alone = ((i, model_checks.forward(model, lambda i=i: model(x[i:i + 1]))[1]) for i in range(len(x)))
    first, failed = next(((i, f) for i, f in alone if f is not None), (None, failed))
    if first is None:
        raise WorkbenchError(f"{name}: {model_checks.batch_only_error(failed, len(x))}")
    shape = tuple(x.shape[1:])
    reads_data = failed.name == "" or any(t.data_ptr() == x[first:first + 1].data_ptr() for t in failed.inputs)
    if not failed.is_shape_error():
        raise WorkbenchError(f"{name}: {model_checks.model_error(failed, shape, name)}")
    if not reads_data:
        raise WorkbenchError(f"{name}: {model_checks.inner_shape_error(failed, shape, name)}")
    where = f" (in {failed.where})" if failed.name else ""
    fix = (f"make the model take inputs of shape {shape} per example"
           + (f" (a width of {x.shape[-1]}: e.g. model.in_features={x.shape[-1]})" if x.dim() == 2 else ""))
    raise WorkbenchError(f"{name}: example {at(first)} does not fit the model: "
                         f"{' '.join(str(failed.error).split())[:300] or type(failed.error).__name__}{where}; {fix}")


def _first_failure(run: Callable[[int, int], Any], n: int, at: Callable[[int], int], name: str, what: str,
                   fix: str) -> Any:
    """run(0, n); if it raises, find the first example that fails alone and raise one line about it."""
    try:
        return run(0, n)
    except WorkbenchError:  # already one line about the model itself (_refuse_lone_values)
        raise
    except Exception as e:  # noqa: BLE001 - any error of the user's model or criterion is refused in one line
        first = next((i for i in range(n) if _fails(run, i)), 0)
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise WorkbenchError(f"{name}: example {at(first)} {what}: {reason}; {fix}") from None


def _fails(run: Callable[[int, int], Any], i: int) -> bool:
    try:
        run(i, i + 1)
        return False
    except Exception:  # noqa: BLE001
        return True


def _check_class_labels(labels: torch.Tensor, classes: int, name: str, ignore_index: int | None,
                        at: Callable[[int], int]) -> None:
    if labels.is_floating_point():
        raise WorkbenchError(f"{name}: labels are {str(labels.dtype).replace('torch.', '')} (example {at(0)}: "
                             f"{labels[0].item():g}) but the model gives {classes} class scores per example; class "
                             "labels must be integers (convert them with .long()), or use a regression model and criterion")
    bad = (labels < 0) | (labels >= classes)
    if ignore_index is not None:
        bad &= labels != ignore_index
    if bad.any():
        i = int(bad.nonzero()[0])
        raise WorkbenchError(f"{name}: example {at(i)} has label {labels[i].item()}, outside the model's {classes} classes "
                             f"(0..{classes - 1}); fix the label or give the model more classes "
                             f"(e.g. model.num_classes={int(labels.max()) + 1})")
