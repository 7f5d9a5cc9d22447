"""Datasets, collators and the loaders.

Training batches are never formed by a DataLoader sampler: the loader takes its batches from the mechanism's Poisson
sampler (workbench/privacy/sampling.py) as given.
"""

from __future__ import annotations

import functools
import logging
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from workbench.errors import WorkbenchError

log = logging.getLogger(__name__)


class ArrayDataset(TensorDataset):
    """A TensorDataset that hands a whole index list back at once (no per-item Python loop in the DataLoader)."""

    def __getitems__(self, indices: Sequence[int]):
        index = torch.as_tensor(indices, dtype=torch.long)
        return tuple(t[index] for t in self.tensors)


class Digits(ArrayDataset):
    """scikit-learn's 8x8 digits, flattened to 64 features in [0, 1]; a fixed stratified split."""

    def __init__(self, split: str = "train", test_size: float = 0.2, split_seed: int = 0):
        if split not in ("train", "eval"):
            raise WorkbenchError(f"Digits split must be 'train' or 'eval', got {split!r}")
        # the file load_digits reads, read without importing scikit-learn (seconds); its split cached by its inputs
        import gzip
        import importlib.util

        from workbench import cache

        sklearn_dir = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
        with gzip.open(sklearn_dir / "datasets" / "data" / "digits.csv.gz") as f:
            raw = np.loadtxt(f, delimiter=",")
        x, y = raw[:, :-1], raw[:, -1].astype(int)
        train, evaluation = cache.cached("digits_split", lambda: _stratified_split(y, test_size, split_seed),
                                         test_size=test_size, split_seed=split_seed, labels=y.tolist(),
                                         code=cache.code_version(packages=("scikit-learn",)))
        rows = train if split == "train" else evaluation
        super().__init__(torch.tensor(x[rows] / 16.0, dtype=torch.float32), torch.tensor(y[rows], dtype=torch.long))


def _stratified_split(y, test_size: float, seed: int) -> list[list[int]]:
    """scikit-learn's stratified train_test_split of the row indices (train, eval)."""
    from sklearn.model_selection import train_test_split

    train, evaluation = train_test_split(list(range(len(y))), test_size=test_size, random_state=seed, stratify=y)
    return [train, evaluation]


class Synthetic(ArrayDataset):
    """Gaussian class blobs: learnable, deterministic, any size."""

    def __init__(self, size: int = 2048, in_features: int = 64, num_classes: int = 10, seed: int = 0, spread: float = 1.0):
        g = torch.Generator().manual_seed(1234)  # class centres shared by every split
        centres = torch.randn(num_classes, in_features, generator=g) * 2.0
        g.manual_seed(seed)
        y = torch.randint(0, num_classes, (size,), generator=g)
        x = centres[y] + spread * torch.randn(size, in_features, generator=g)
        super().__init__(x, y)


class SyntheticImages(ArrayDataset):
    """CIFAR-shaped images (3x32x32 in [0, 1], 10 classes) made on the fly: each class a colour-tinted sinusoidal grating
    of its own orientation and frequency, at a random phase per image, under Gaussian pixel noise. Learnable by a
    small CNN in seconds, deterministic, any size."""

    def __init__(self, size: int = 4096, num_classes: int = 10, seed: int = 0, noise: float = 0.3,
                 image_size: int = 32):
        g = torch.Generator().manual_seed(1234)  # class patterns shared by every split
        angle = torch.arange(num_classes) * torch.pi / num_classes * 3 % torch.pi  # neighbours' angles far apart
        frequency = 2 * torch.pi * (2 + torch.arange(num_classes) % 3) / image_size
        tint = 0.5 + torch.rand(num_classes, 3, 1, 1, generator=g)
        g.manual_seed(seed)
        y = torch.randint(0, num_classes, (size,), generator=g)
        phase = 2 * torch.pi * torch.rand(size, 1, 1, generator=g)
        r = torch.arange(image_size, dtype=torch.float32)
        along = torch.cos(angle[y])[:, None, None] * r[None, :, None] + torch.sin(angle[y])[:, None, None] * r[None, None, :]
        wave = torch.cos(frequency[y][:, None, None] * along + phase)  # (size, H, W)
        x = 0.5 + 0.25 * tint[y] * wave[:, None] + noise * torch.randn(size, 3, image_size, image_size, generator=g)
        super().__init__(x.clamp(0, 1), y)


class CIFAR10(ArrayDataset):
    """The real CIFAR-10 from its python-pickle folder, as ``torchvision.datasets.CIFAR10(root, train,
    download=False)`` reads it: ``root/cifar-10-batches-py/data_batch_1..5`` (train) or ``test_batch`` (eval), each a
    pickled dict with ``data`` (N x 3072 uint8, channel-major) and ``labels``. Images as 3x32x32 floats in [0, 1]."""

    FOLDER = "cifar-10-batches-py"

    def __init__(self, root: str, train: bool = True):
        folder = Path(root).expanduser() / self.FOLDER
        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise WorkbenchError(f"CIFAR-10 not found: {folder / missing[0]} is missing (extract the python version, "
                                 f"cifar-10-python.tar.gz, under {root}; nothing is downloaded)")
        images, labels = [], []
        for name in names:
            with open(folder / name, "rb") as f:
                batch = _ArraysOnly(f, encoding="latin1").load()  # written by Python 2: latin1, as torchvision reads it
            images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.extend(batch["labels"])
        x = torch.from_numpy(np.concatenate(images)).float() / 255
        super().__init__(x, torch.tensor(labels, dtype=torch.long))


class _ArraysOnly(pickle.Unpickler):
    """Unpickles dicts, lists and numpy arrays only: a downloaded file cannot run code when it is read."""

    def find_class(self, module: str, name: str):
        if (module.split(".")[0] == "numpy" and name in ("_reconstruct", "ndarray", "dtype", "_frombuffer", "scalar")
                or (module, name) == ("_codecs", "encode")):  # how Python 3 writes bytes at protocol 2
            return super().find_class(module, name)
        raise WorkbenchError(f"refusing to unpickle {module}.{name}: a CIFAR-10 batch holds only arrays and lists")


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
    if isinstance(raw, Mapping):
        inputs = dict(raw)
        key = "labels" if "labels" in inputs else "label" if "label" in inputs else None
        if key is None:
            raise WorkbenchError(f"a mapping batch needs a 'labels' entry for the loss; it has {sorted(inputs)}")
        labels = inputs.pop(key)
        return Batch((), inputs, torch.as_tensor(labels))
    if isinstance(raw, (tuple, list)) and len(raw) >= 2:
        return Batch(tuple(raw[:-1]), {}, torch.as_tensor(raw[-1]))
    raise WorkbenchError(f"a batch must be (x, y), (x1, ..., xk, y) or a mapping with 'labels', not "
                         f"{type(raw).__name__}{'' if not isinstance(raw, (tuple, list)) else f' of {len(raw)}'}")


def _loader_kwargs(cfg, device: torch.device, collator: Callable | None) -> dict:
    kwargs = dict(num_workers=cfg.dataloader_num_workers, collate_fn=functools.partial(collate, collator=collator),
                  pin_memory=bool(cfg.dataloader_pin_memory and device.type == "cuda"))
    if cfg.dataloader_num_workers > 0:
        kwargs.update(persistent_workers=cfg.dataloader_persistent_workers,
                      prefetch_factor=cfg.dataloader_prefetch_factor)
    return kwargs


def train_loader(dataset: Dataset, sampler, cfg, device: torch.device,
                 collator: Callable | None = None) -> DataLoader:
    return DataLoader(dataset, batch_sampler=sampler, **_loader_kwargs(cfg, device, collator))


def first_examples(dataset: Dataset, count: int, collator: Callable | None = None):
    """The dataset's first ``count`` examples, collated as the training loader collates: for checks before training."""
    return next(iter(DataLoader(dataset, batch_sampler=[list(range(min(len(dataset), count)))],
                                collate_fn=functools.partial(collate, collator=collator))))


def eval_shard(dataset_size: int, rank: int, world_size: int) -> range:
    """Contiguous, near-equal, never padded: the gathered predictions are the dataset in order, each example once."""
    return range(rank * dataset_size // world_size, (rank + 1) * dataset_size // world_size)


def eval_loader(dataset: Dataset, indices: range, cfg, device: torch.device,
                collator: Callable | None = None) -> DataLoader:
    batches = [list(indices[i:i + cfg.per_device_eval_batch_size])
               for i in range(0, len(indices), cfg.per_device_eval_batch_size)]
    if cfg.dataloader_drop_last and batches and len(batches[-1]) < cfg.per_device_eval_batch_size:
        batches.pop()
    return DataLoader(dataset, batch_sampler=batches, **_loader_kwargs(cfg, device, collator))


def check_dataset(dataset: Dataset, name: str) -> int:
    try:
        size = len(dataset)
    except TypeError:
        raise WorkbenchError(f"the {name} dataset must be a map-style Dataset with __len__ (Poisson sampling needs N)") from None
    if size == 0:
        raise WorkbenchError(f"the {name} dataset is empty")
    return size
