"""What a batch is: the collation of a sampler's draw (an empty Poisson draw is None), :class:`PadCollator` for
variable-length token sequences, and :class:`Batch`, the one shape the step and the evaluator read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.data import default_collate

from workbench.errors import WorkbenchError


def collate(batch, collator: Callable | None = None):
    """Collation for our sampler's draws: an empty draw is None, a pre-batched draw (the dataset's ``__getitems__``
    returned a tuple or mapping of tensors) passes as it is, a list of examples goes to ``collator`` (``data.collator``,
    e.g. :class:`PadCollator` for variable-length text), else to torch's default_collate."""
    if isinstance(batch, (tuple, Mapping)):
        return batch
    if len(batch) == 0:
        return None
    return (collator or default_collate)(batch)


class PadCollator:
    """Pads a list of examples (mappings of token sequences, HF style) to the longest one in the batch.

    ``labels`` are padded with ``label_pad_id`` (-100: ignored by the token loss), ``attention_mask`` and
    ``token_type_ids`` with 0, every other sequence with ``pad_token_id``; scalars (a class label) are stacked.
    """

    def __init__(self, pad_token_id: int = 0, label_pad_id: int = -100, pad_to_multiple_of: int | None = None):
        self.pad_token_id, self.label_pad_id, self.multiple = pad_token_id, label_pad_id, pad_to_multiple_of

    def _pad_value(self, key: str) -> int:
        if key == "labels":
            return self.label_pad_id
        return 0 if key in ("attention_mask", "token_type_ids") else self.pad_token_id

    def __call__(self, examples: list[Mapping]) -> dict[str, torch.Tensor]:
        if not all(isinstance(e, Mapping) for e in examples):
            raise WorkbenchError("data.collator=PadCollator needs examples that are mappings (input_ids, labels, ...)")
        out = {}
        for key in examples[0]:
            values = [torch.as_tensor(e[key]) for e in examples]
            if values[0].dim() == 0:
                out[key] = torch.stack(values)
                continue
            length = max(len(v) for v in values)
            if self.multiple:
                length = -(-length // self.multiple) * self.multiple
            padded = torch.full((len(values), length), self._pad_value(key), dtype=values[0].dtype)
            for i, v in enumerate(values):
                padded[i, :len(v)] = v
            out[key] = padded
        return out


@dataclass
class Batch:
    """One batch as the trainer reads it, whatever the dataset yields: the model's inputs and the labels.

    ``(x, y)`` and ``(x1, ..., xk, y)`` give positional inputs; a mapping (HF style) gives keyword inputs, with
    ``labels`` (or ``label``) taken out for the loss: ``model(*args, **kwargs)``.
    """

    args: tuple
    kwargs: dict[str, Any]
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Batch":
        def apply(v):
            return fn(v) if isinstance(v, torch.Tensor) else v
        return Batch(tuple(apply(a) for a in self.args), {k: apply(v) for k, v in self.kwargs.items()}, fn(self.labels))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def on_cpu(self) -> bool:
        """Whether every tensor is on the CPU already (``to("cpu")`` would return each as it is)."""
        return self.labels.is_cpu and all(t.is_cpu for t in (*self.args, *self.kwargs.values())
                                          if isinstance(t, torch.Tensor))

    def slice(self, start: int, end: int) -> "Batch":
        """Examples [start, end) of every input whose first dimension is the batch (others are shared as they are)."""
        n = len(self)
        return self._map(lambda t: t[start:end] if t.dim() > 0 and t.shape[0] == n else t)

    def forward(self, model: Callable) -> Any:
        return model(*self.args, **self.kwargs)


def as_batch(raw: Any) -> Batch | None:
    """A collated batch (None for an empty Poisson draw) in the trainer's one shape."""
    if raw is None or isinstance(raw, Batch):
        return raw
    if isinstance(raw, (tuple, list)) and len(raw) >= 2:  # the common (x, y) first: the Mapping check is slower
        return Batch(tuple(raw[:-1]), {}, torch.as_tensor(raw[-1]))
    if isinstance(raw, Mapping):
        inputs = dict(raw)
        key = "labels" if "labels" in inputs else "label" if "label" in inputs else None
        if key is None:
            raise WorkbenchError(f"a mapping batch needs a 'labels' entry for the loss; it has {sorted(inputs)}")
        labels = inputs.pop(key)
        return Batch((), inputs, torch.as_tensor(labels))
    raise WorkbenchError(f"a batch must be (x, y), (x1, ..., xk, y) or a mapping with 'labels', not "
                         f"{type(raw).__name__}{'' if not isinstance(raw, (tuple, list)) else f' of {len(raw)}'}")
