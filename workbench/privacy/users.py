"""User-level DP (docs/DESIGN.md, "User-level privacy"): the unit of privacy is a user, not an example.

``privacy.unit=user`` with ``data.user_key`` naming each example's user (workbench/data/users.py reads it):

- **Population**: the users. N_users is public, as N is at example level; ``shard`` modes are the example-level
  ones applied to the list of users (:func:`user_shard`): per_rank = disjoint contiguous groups of users (a tail of
  fewer than W users dropped with a warning), global = every rank sees every user at rate B / (W N_users).
- **Sampling**: each user is drawn with probability q = B_users / N_users (B = ``per_device_train_batch_size`` x W, now
  counted in users), from the same secret per-(seed, rank, step) streams as example-level Poisson sampling
  (:class:`UserPoissonSampler`, a :class:`~workbench.privacy.sampling.PoissonBatchSampler` over user positions).
- **The cap**: a drawn user contributes at most k = ``privacy.max_examples_per_user`` of its examples, the same k
  every time it is drawn: a user with more keeps k of them chosen uniformly at random, once per run, from a stream
  seeded by (``data_seed`` or ``seed``, a hash of the user's own id) (:func:`index_users`). The choice depends on
  that user alone (never on which other users exist), so adding or removing a user changes one unit only.
- **Clipping**: the user's combined gradient, the *mean* of its (at most k) examples' gradients, is clipped to C as
  one unit (workbench/privacy/clipping/per_user.py), with the floating-point bound of clipping/bound.py per user.
- **Accounting**: the example-level accountant with q_user and the run's steps, delta below 1/N_users: epsilon is
  per user (MLflow tag ``privacy_unit=user``, the closing line, the plots).
- **Adaptive clipping** (``privacy.clipping=adaptive``): the clipped count is over the step's users (per_user.py),
  its B the expected batch of users; accounted as the fixed-C user-level run at sigma (clipping/adaptive.py).
- **BandMF** (``privacy.mechanism=bandmf``, shard=per_rank): cyclic Poisson over users (:class:`UserCyclicSampler`:
  the rank's users in b strided parts, part t mod b drawn at p = b B_users / N_users_used), accounted as amplified
  BandMF over users (accounting/banded.py at that p); the rank's user shard is cut to a multiple of b users.
- **Audit** (``audit=canaries``, workbench/privacy/auditing/canaries.py): each of the m canary slots is a user of its
  own (:class:`CanaryUser`) with that one slot as its only example, appended after the data's users
  (:func:`with_canary_users`): N_users and q count them whatever their membership, they are sampled, clipped (a
  user's mean of one gradient is that gradient) and noised as every user is, and the audit's bound is per user.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from statistics import median
from typing import Any, Sequence

import numpy as np
import torch

from workbench.errors import WorkbenchError
from workbench.privacy.cyclic import CyclicPoissonBatchSampler
from workbench.privacy.mechanism import Mechanism, plan
from workbench.privacy.sampling import PoissonBatchSampler, Shard, train_shard


@dataclass(frozen=True)
class UserIndex:
    """The users of a training set, in order of first appearance, and what each may contribute."""

    users: list  # user ids, by position
    examples: list[list[int]]  # per user position: the dataset indices it contributes (at most `cap`, ascending)
    sizes: list[int]  # per user position: how many examples the user has before the cap
    cap: int  # k = privacy.max_examples_per_user
    canaries: int = 0  # audit=canaries: the last `canaries` users are the audit's canary users, one slot each

    def __len__(self) -> int:
        return len(self.users)

    @property
    def dropped(self) -> int:
        """Examples the cap leaves out of training."""
        return sum(self.sizes) - sum(len(e) for e in self.examples)

    def describe(self) -> str:
        """The data check's line: the data's users' sizes and what the cap drops (the audit's canary users are not
        the data's: left out of the sizes, counted apart). Read from the raw data: printed on the console of whoever
        runs the job, never sent to MLflow (it is not a differentially private release)."""
        s = self.sizes[:len(self.sizes) - self.canaries]
        line = (f"privacy.unit=user: {len(s)} users, examples per user min {min(s)} / median {median(s):g} / max "
                f"{max(s)}; privacy.max_examples_per_user={self.cap} drops {self.dropped} of {sum(s)} examples")
        if self.canaries:
            line += (f"; audit=canaries adds {self.canaries} canary users of 1 example each "
                     f"({len(self.sizes)} users sampled and accounted)")
        return line


def _key(user: Any) -> Any:
    if isinstance(user, torch.Tensor):
        if user.numel() != 1:
            raise WorkbenchError(f"data.user_key: a user id must be one value (an int or a string), got a tensor of "
                                 f"shape {tuple(user.shape)}")
        user = user.item()
    if isinstance(user, np.generic):
        user = user.item()
    # A missing id is no user: None would merge every such example into one user, NaN (never equal to itself) make
    # each its own; either breaks the bound on what one person contributes.
    if user is None or (isinstance(user, float) and user != user):
        raise WorkbenchError(f"data.user_key: an example has no user id ({user!r}); give every example its user, or "
                             "drop the examples without one")
    try:
        hash(user)
    except TypeError:
        raise WorkbenchError(f"data.user_key: a user id must be hashable (an int or a string), got "
                             f"{type(user).__name__}") from None
    return user


def _user_seed(seed: int, user: Any) -> np.random.SeedSequence:
    digest = hashlib.sha256(f"{type(user).__name__}:{user!r}".encode()).digest()
    return np.random.SeedSequence([seed, int.from_bytes(digest[:8], "little")])


def index_users(user_of: Sequence[Any], cap: int, seed: int) -> UserIndex:
    """The users of examples whose users are ``user_of`` (one id per example, dataset order), each keeping at most
    ``cap`` examples: all of them when it has no more, else ``cap`` chosen uniformly without replacement from the
    stream of (``seed``, a hash of its id), kept in dataset order."""
    if cap < 1:
        raise WorkbenchError(f"privacy.max_examples_per_user must be >= 1, got {cap}")
    position: dict[Any, int] = {}
    users: list = []
    members: list[list[int]] = []
    for i, user in enumerate(user_of):
        user = _key(user)
        at = position.get(user)
        if at is None:
            position[user] = at = len(users)
            users.append(user)
            members.append([])
        members[at].append(i)
    if not users:
        raise WorkbenchError("the training dataset has no users")
    kept = []
    for user, own in zip(users, members):
        if len(own) > cap:
            pick = np.random.default_rng(_user_seed(seed, user)).choice(len(own), size=cap, replace=False)
            own = [own[j] for j in sorted(pick.tolist())]
        kept.append(own)
    return UserIndex(users, kept, [len(m) for m in members], cap)


@dataclass(frozen=True)
class CanaryUser:
    """The user id of the audit's canary slot ``slot`` (0-based): a type no ``data.user_key`` gives, so never equal
    to one of the data's users."""

    slot: int


def with_canary_users(index: UserIndex, first_slot: int, m: int) -> UserIndex:
    """``index`` with m users appended, canary user j holding the one dataset index ``first_slot + j`` (the audit's
    slot j: workbench/privacy/auditing/canaries.py, CanaryDataset)."""
    if index.canaries:
        raise ValueError("the index already has canary users")
    return UserIndex(index.users + [CanaryUser(j) for j in range(m)],
                     index.examples + [[first_slot + j] for j in range(m)], index.sizes + [1] * m, index.cap, m)


def user_shard(index: UserIndex, rank: int, world_size: int, mode: str, per_device_batch: int) -> Shard:
    """The example-level shard modes over user positions: population N_users, rate q = B_users / N_users."""
    n = len(index)
    if mode == "per_rank" and n < world_size:
        raise WorkbenchError(f"privacy.unit=user: the training set has {n} users, fewer than world_size={world_size}")
    used = n // world_size * world_size if mode == "per_rank" else n
    if per_device_batch * world_size > used:
        raise WorkbenchError(
            f"privacy.unit=user: the expected global batch per_device_train_batch_size x world_size = "
            f"{per_device_batch * world_size} users is more than the {used} users of the training set; lower "
            "per_device_train_batch_size (counted in users)")
    return train_shard(n, rank, world_size, mode, per_device_batch)


class _UserDraws:
    """An example-level sampler run over user positions, yielding the drawn users' capped examples, user after
    user (mixed in before the sampler: ``super().indices_for_step`` draws the users)."""

    index: UserIndex

    def users_for_step(self, step: int) -> list[int]:
        return super().indices_for_step(step)

    def indices_for_step(self, step: int) -> list[int]:
        return [i for u in self.users_for_step(step) for i in self.index.examples[u]]

    def sizes_for_step(self, step: int) -> list[int]:
        """How many examples each drawn user has in ``indices_for_step(step)``, in that order."""
        return [len(self.index.examples[u]) for u in self.users_for_step(step)]


class UserPoissonSampler(_UserDraws, PoissonBatchSampler):
    """Each step: every user of the shard drawn independently with probability q (the example-level sampler's
    streams, over user positions)."""

    def __init__(self, shard: Shard, steps: int, seed: int, rank: int, index: UserIndex, start_step: int = 0):
        super().__init__(shard, steps, seed, rank, start_step)
        self.index = index


class UserCyclicSampler(_UserDraws, CyclicPoissonBatchSampler):
    """privacy.mechanism=bandmf over users: the rank's users split into b parts by user position (strided, as
    cyclic.py splits examples), part t mod b Poisson-sampled at p = b B_users / N_users_used at step t; a user is
    drawn at most once every b steps, with all its capped examples."""

    def __init__(self, shard: Shard, num_bands: int, steps: int, seed: int, rank: int, index: UserIndex,
                 start_step: int = 0):
        super().__init__(shard, num_bands, steps, seed, rank, start_step)
        self.index = index


@dataclass
class UserMechanism(Mechanism):
    """The mechanism with a user as the unit: ``shard`` is over user positions (population N_users, rate q_user,
    expected batch B_users), the accountant is of that q, and the sampler draws users."""

    users: UserIndex | None = None
    unit = "user"

    def sampler(self, seed: int, rank: int, start_step: int = 0) -> UserPoissonSampler | UserCyclicSampler:
        if self.kind == "bandmf":  # plan() recut the user shard into b equal parts (cyclic.py's banded_shard)
            return UserCyclicSampler(self.shard, self.num_bands, self.steps, seed, rank, self.users, start_step)
        return UserPoissonSampler(self.shard, self.steps, seed, rank, self.users, start_step)

    def event_fields(self) -> dict[str, Any]:
        found = super().event_fields()
        if self.private:
            found.update(unit="user", max_examples_per_user=self.users.cap)
        return found


def plan_users(p: Any, index: UserIndex, shard: Shard, shard_mode: str, world_size: int, steps: int) -> UserMechanism:
    """:func:`~workbench.privacy.mechanism.plan` over users (the same calibration and budget cut, q = q_user, delta
    below 1/N_users), as a :class:`UserMechanism`."""
    m = plan(p, shard, shard_mode, world_size, steps, unit="users")
    return UserMechanism(**{f.name: getattr(m, f.name) for f in fields(Mechanism)}, users=index)
