"""The loaders: training batches exactly as the mechanism's Poisson sampler draws them (workbench/privacy/sampling.py;
never a DataLoader sampler), the eval set in contiguous shards, and the examples the pre-run checks read."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset

from workbench.data.batches import collate
from workbench.errors import WorkbenchError


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


def examples(dataset: Any, indices: list[int], collator: Callable | None = None):
    """These examples of the dataset, collated as the training loader collates them."""
    return next(iter(DataLoader(dataset, batch_sampler=[list(indices)],
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
