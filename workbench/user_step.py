"""One logical step of user-level DP-SGD on one rank (``privacy.unit=user``, workbench/privacy/users.py).

The example-level step (workbench/step.py) with two changes: its micro-batches hold whole users (a user's examples
are never split, so its mean gradient is formed in one place), and its strategy clips each user's mean gradient to C
as one unit (workbench/privacy/clipping/per_user.py). The noise (sigma C, rank 0, before the one all-reduce) and the
division by the expected batch, now of users, are the example-level step's and loop's, unchanged.

The loader yields ``(batch, sizes)``: the collated examples of the drawn users, user after user, and how many each
has (workbench/data/users.py, :class:`~workbench.data.users.UserBatches`).
"""

from __future__ import annotations

from typing import Any

from workbench.errors import WorkbenchError
from workbench.privacy.clipping.per_user import BK_REFUSAL, PerUser
from workbench.step import GradientStep


def pack(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive users in groups of at most ``limit`` examples (a user is never split; one larger than ``limit`` is
    refused: privacy.max_examples_per_user <= max_physical_batch_size is checked before any work)."""
    groups: list[list[int]] = []
    total = limit + 1
    for size in sizes:
        if size > limit:
            raise WorkbenchError(f"a user contributes {size} examples, more than max_physical_batch_size={limit}")
        if total + size > limit:
            groups.append([])
            total = 0
        groups[-1].append(size)
        total += size
    return groups


class UserGradientStep(GradientStep):
    """GradientStep with a user as the unit: call it with ``(batch, sizes)``."""

    def __init__(self, *args, **kwargs):
        self._sizes: list[int] = []
        super().__init__(*args, **kwargs)
        if not self.private:
            raise WorkbenchError("privacy.unit=user needs privacy.enabled=true")

    def _make(self, mode: str) -> None:
        if mode == "bk":
            if "bk" not in self.candidates:
                raise WorkbenchError(BK_REFUSAL)
            self.candidates.remove("bk")  # auto: the materialising modes only
            mode = self.candidates[0]
        super()._make(mode)
        if self.private:
            self.clipper = PerUser(self.clipper, self.clip)
            self.clipper.max_batch = self.bound_batch

    def __call__(self, item: Any, step: int) -> tuple[float, float]:
        batch, self._sizes = item
        return super().__call__(batch, step)

    def _micro_batches(self, batch):
        start = 0
        if sum(self._sizes) != len(batch):
            raise WorkbenchError(f"the batch has {len(batch)} examples, its users {sum(self._sizes)}")
        for group in pack(self._sizes, self.max_physical_batch_size):
            end = start + sum(group)
            micro = batch.slice(start, end)
            micro.user_sizes = group
            yield micro
            start = end
