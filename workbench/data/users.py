"""The data side of user-level DP (``privacy.unit=user``; the mechanism is workbench/privacy/users.py): which user each
training example belongs to (``data.user_key``), the loader that tells the step how many examples each drawn user
has, and a synthetic dataset of users of very different sizes.

``data.user_key`` is one of:
- a string naming an attribute of the dataset that holds one user id per example (``users``: tuple datasets such as
  :class:`SyntheticUsers`);
- a string naming a field of every example (HF-style mappings: ``{"input_ids": ..., "labels": ..., "user": ...}``);
  the field is then removed from the examples the model sees (:class:`WithoutKey`);
- a ``_target_`` callable, instantiated as a partial, called with each example (``fn(example) -> user id``).
User ids are ints or strings (0-d tensors are read as their value).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset

from workbench.data.datasets import ArrayDataset
from workbench.errors import WorkbenchError


class WithoutKey(Dataset):
    """A mapping-example dataset seen without one field (the user id: not a model input)."""

    def __init__(self, dataset: Dataset, key: str):
        self.dataset, self.key = dataset, key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return {k: v for k, v in self.dataset[i].items() if k != self.key}


def user_ids(dataset: Dataset, user_key: Any, by_example: Callable | None = None) -> tuple[list, Dataset]:
    """Each example's user (dataset order) and the dataset the model is to see (without a user field).
    ``by_example``: the instantiated callable when ``data.user_key`` is a ``_target_`` node."""
    n = len(dataset)
    if by_example is not None:
        return [by_example(dataset[i]) for i in range(n)], dataset
    if not isinstance(user_key, str) or not user_key:
        raise WorkbenchError("privacy.unit=user needs data.user_key: a dataset attribute, an example field or a "
                             "_target_ callable giving each example's user")
    if hasattr(dataset, user_key):
        found = getattr(dataset, user_key)
        found = found.tolist() if isinstance(found, torch.Tensor) else list(found)
        if len(found) != n:
            raise WorkbenchError(f"data.user_key={user_key!r}: the dataset's {user_key} has {len(found)} entries for "
                                 f"{n} examples")
        return found, dataset
    first = dataset[0]
    if not isinstance(first, Mapping) or user_key not in first:
        raise WorkbenchError(f"data.user_key={user_key!r} is neither an attribute of the training dataset "
                             f"({type(dataset).__name__}) nor a field of its examples")
    return [dataset[i][user_key] for i in range(n)], WithoutKey(dataset, user_key)


class UserBatches:
    """The training loader for user-level DP: yields ``(batch, sizes)`` per logical step, ``sizes`` the examples of
    each drawn user in the batch's order (from the sampler: workbench/privacy/users.py, UserPoissonSampler)."""

    def __init__(self, loader):
        self.loader = loader
        self.dataset, self.batch_sampler = loader.dataset, loader.batch_sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[Any, list[int]]]:
        sampler = self.batch_sampler
        for step, batch in zip(range(sampler.start_step, sampler.steps), self.loader):
            yield batch, sampler.sizes_for_step(step)


class SyntheticUsers(ArrayDataset):
    """Gaussian class blobs (as :class:`~workbench.data.datasets.Synthetic`) written by ``num_users`` users of very
    different sizes: user u has about ``size_scale`` / (u+1)^``zipf`` examples (at least one; a Zipf law: a few users
    write most examples) and a style of its own (a fixed offset of its inputs). ``users`` holds each example's user
    (``data.user_key=users``)."""

    def __init__(self, num_users: int = 1000, zipf: float = 0.9, size_scale: float = 300.0, in_features: int = 64,
                 num_classes: int = 10, seed: int = 0, spread: float = 5.0, style: float = 1.0):
        g = torch.Generator().manual_seed(1234)  # class centres shared by every split
        centres = torch.randn(num_classes, in_features, generator=g) * 2.0
        g.manual_seed(seed)
        ranks = torch.randperm(num_users, generator=g).double()  # which user is how large: shuffled
        sizes = (size_scale / (ranks + 1) ** zipf).ceil().long().clamp(min=1)
        users = torch.repeat_interleave(torch.arange(num_users), sizes)
        users = users[torch.randperm(len(users), generator=g)]  # examples of a user are spread over the dataset
        y = torch.randint(0, num_classes, (len(users),), generator=g)
        offset = style * torch.randn(num_users, in_features, generator=g)
        x = centres[y] + offset[users] + spread * torch.randn(len(users), in_features, generator=g)
        super().__init__(x, y)
        self.users = users
