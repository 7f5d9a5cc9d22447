"""Canaries for the one-run audit (``audit=canaries``): m Dirac gradient canaries that only the audit sees.

- **Data.** The training set gets m extra slots after its own N examples (so N + m is the population the sampler and the
  accountant see, whatever the membership). Slot j holds canary j if it drew "member" (probability 1/2, from the run's
  secret, separate from the sampling and noise streams), else a blank example. Canary and blank slots go through the
  same Poisson sampler, clipping, noise, all-reduce and accounting as every example: there is no separate path.
- **Model.** Training runs on :class:`AuditedModel`: the user's model plus a canary block ``audit.canaries`` (an
  ``nn.Linear(m, 1)`` at zero, so every per-sample mode supports it). Ordinary examples feed it a zero input: its
  gradient from them is exactly 0. A slot's user-model output is detached: a slot's gradient on the user's parameters
  is exactly 0. Canary j's loss is ``C * w_j``: its gradient is C e_j (norm C, so clipping leaves norm C up to the
  trainer's stabiliser); a blank's is 0.
- **Observers.** White-box (:class:`WhiteBoxObserver`): every released update's coordinate j, in units of C / B, is
  K_t + sigma Z_t; scored by the exact likelihood ratio (:func:`workbench.privacy.auditing.bound.block_llr`). Final
  model: how far w_j moved against its gradient, ``-w_j``.
- **BandMF** (``privacy.mechanism=bandmf``): the released coordinate sequence is y = K + sigma C^{-1} Z, C the public
  b-banded lower-triangular Toeplitz strategy (c_0..c_{b-1}). The observer whitens it, (C y)_t = (C K)_t + sigma z_t,
  z iid N(0, 1). Canary j can take part only at steps s = r_j mod b (r_j its cyclic part, workbench/privacy/cyclic.py's
  ``part_of``), at most one in every b steps, and column s of C is non-zero on rows s..s+b-1 only: so the whitened rows
  split into disjoint blocks, v_s = K_s c_s + sigma z with c_s column s of C on those rows (cut at T), and the exact
  log-likelihood ratio is the sum over s of :func:`block_llr` (K_s Bernoulli(p), the in-band rate). DP-SGD is the case
  b = 1, c = (1,): one code path.
- **Adaptive clipping** (``privacy.clipping=adaptive``): the canary's gradient follows C_t (its loss gain is read from the
  schedule at each forward), and the observer reads step t in units of C_t / B with the gradient's noise sigma_g. The
  clipped count the step also releases sees the canary too; the white-box observer ignores that channel: ignoring
  information only weakens the attack, so the bound stays valid (and no stronger than it could be).
- **Shards.** Slots sit after the N examples; ``shard=per_rank`` drops the population's tail beyond a multiple of W,
  so up to W - 1 slots may never be sampled: the bound stays valid, those canaries only carry no signal.
- **User level** (``privacy.unit=user``): canary slot j is a *canary user*, a user of its own with the slot as its
  one example (:meth:`CanaryAudit.users`; the user id is :class:`workbench.privacy.users.CanaryUser`), appended after
  the data's users. It joins the users' population whatever its membership (N_users and q_user count it), is drawn
  with probability q_user like every user, and its mean gradient (of one example: C e_j) is clipped to C as one unit.
  The released coordinate j is still K_t + sigma Z_t in units of C / B, B now the expected batch of users and K_t the
  canary user's multiplicity (the same Bernoulli/Binomial law, of q_user), so the white-box likelihood ratio is exact
  as it is; the observers score users and the bound is on epsilon per user. A canary user of one example is the
  simplest valid choice: the mean of several copies of C e_j would be the same C e_j.
- **What is kept.** The user's model never holds the block; checkpoints hold the user's model only, and the optimizer
  state for the block is left out (:meth:`CanaryAudit.without_canaries`). The audit's own state (the block, its
  optimizer state, the observer's scores and open blocks) goes into the run folder's checkpoint as private state
  (``audit``: never MLflow), so a resumed audited run ends with the scores of an uninterrupted one
  (:meth:`CanaryAudit.state_dict`); the membership is redrawn from the secret the checkpoint keeps.

Examples reach the model with their slot id as one extra trailing feature (0: ordinary, j + 1: canary j, -1: blank),
so the dataset must yield ``(x, y)`` with a tensor ``x``; :class:`AuditedModel` strips the feature before the user's model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from workbench.privacy.auditing import bound as audit_bound
from workbench.errors import WorkbenchError

if TYPE_CHECKING:
    from workbench.privacy.mechanism import Mechanism
    from workbench.privacy.users import UserIndex

BLOCK = "audit.canaries"
_MEMBERSHIP_STREAM = 0xA0D17  # keeps the membership draw apart from every other use of the secret


def _tag(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.reshape(len(x), -1), ids.to(x.dtype).unsqueeze(1)], dim=1)


class CanaryDataset(Dataset):
    """The user's N examples, then m slots (canary or blank); every example comes back tagged with its slot id."""

    def __init__(self, base: Dataset, m: int):
        self.base, self.m, self.n = base, m, len(base)
        first = base[0]
        if not (isinstance(first, (tuple, list)) and len(first) == 2 and isinstance(first[0], torch.Tensor)):
            raise WorkbenchError("audit=canaries needs a training set of (x, y) examples with a tensor x")
        self.template_x, self.template_y = torch.zeros_like(first[0]), torch.as_tensor(first[1])
        if self.template_x.is_floating_point() and m + 1 > 2 / torch.finfo(self.template_x.dtype).eps:
            raise WorkbenchError(f"audit.canaries={m} cannot be told apart in {self.template_x.dtype} inputs")
        self.ids: torch.Tensor | None = None  # per slot: j + 1 for a member canary, -1 for a blank

    def draw_membership(self, secret: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng(np.random.SeedSequence([secret, seed, _MEMBERSHIP_STREAM]))
        members = rng.random(self.m) < 0.5
        self.ids = torch.where(torch.from_numpy(members), torch.arange(1, self.m + 1), torch.tensor(-1))
        return members

    def __len__(self) -> int:
        return self.n + self.m

    def __getitem__(self, i: int):
        return self.__getitems__([i])  # collate passes a pre-batched tuple through

    def __getitems__(self, indices):
        index = torch.as_tensor(indices, dtype=torch.long)
        is_slot = index >= self.n
        ordinary, slots = index[~is_slot].tolist(), index[is_slot] - self.n
        parts = []
        if ordinary:
            got = self.base.__getitems__(ordinary) if hasattr(self.base, "__getitems__") else \
                [self.base[i] for i in ordinary]
            x, y = got if isinstance(got, tuple) else default_collate(list(got))
            parts.append((_tag(x, torch.zeros(len(x), dtype=torch.long)), torch.as_tensor(y)))
        if len(slots):
            if self.ids is None:
                raise RuntimeError("canary membership is drawn once the run's secret is known, before training")
            x = self.template_x.expand(len(slots), *self.template_x.shape)
            parts.append((_tag(x, self.ids[slots]), self.template_y.expand(len(slots), *self.template_y.shape)))
        out = tuple(torch.cat(t) for t in zip(*parts))
        if len(slots) and len(ordinary) and bool((is_slot[:-1] & ~is_slot[1:]).any()):
            # A slot before an ordinary example: back to the order asked for (privacy.unit=user reads a batch as
            # user after user, each user's examples where the sampler put them).
            at = torch.cat([(~is_slot).nonzero().squeeze(1), is_slot.nonzero().squeeze(1)])
            out = tuple(t[torch.argsort(at)] for t in out)
        return out


class AuditedModel(nn.Module):
    """The module training runs on: the user's model, plus the canary block that only slot examples reach."""

    def __init__(self, model: nn.Module, m: int, example_shape: torch.Size):
        super().__init__()
        self.model, self.m, self.example_shape = model, m, tuple(example_shape)
        self.canaries = nn.Linear(m, 1, bias=False)
        nn.init.zeros_(self.canaries.weight)
        first = next(p for p in model.parameters() if p.requires_grad)
        self.canaries.to(device=first.device, dtype=first.dtype)  # one flat gradient buffer needs one dtype
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (is_slot, canary term) for AuditedCriterion

    def forward(self, tagged: torch.Tensor) -> torch.Tensor:
        ids = tagged[:, -1].round().long()
        out = self.model(tagged[:, :-1].reshape(len(tagged), *self.example_shape))
        is_slot = ids != 0
        out = torch.where(is_slot.view(-1, *[1] * (out.dim() - 1)), out.detach(), out)
        onehot = nn.functional.one_hot((ids - 1).clamp(min=0), self.m) * (ids > 0).unsqueeze(1)
        self.last = (is_slot, self.canaries(onehot.to(self.canaries.weight.dtype)).squeeze(1))
        return out


class AuditedCriterion(nn.Module):
    """The user's per-example loss for ordinary examples; ``gain() * w_j`` for canary j (gain: the step's C, C_t with
    adaptive clipping, read at each forward); 0 (no gradient) for a blank."""

    def __init__(self, criterion: nn.Module, model: AuditedModel, gain: Callable[[], float]):
        super().__init__()
        self.criterion, self.audited, self.gain = criterion, model, gain

    def forward(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses = self.criterion(output, y)
        is_slot, term = self.audited.last
        return torch.where(is_slot, self.gain() * term.to(losses.dtype), losses)


class WhiteBoxObserver:
    """A callback that sees every released update of the canary block and sums each canary's exact log-likelihood
    ratio, block by whitened block (module docstring; DP-SGD: ``coefficients=(1.0,)``, every step its own block).

    ``clip()`` is the schedule's C for the *next* step: read once before the first step and after each (the schedule
    has moved by then), so step t is read in units of its own C_t / B."""

    def __init__(self, m: int, clip: Callable[[], float], expected_batch: float, sigma: float, probs: np.ndarray,
                 coefficients: tuple[float, ...] = (1.0,), bands: np.ndarray | None = None):
        self.clip, self.expected_batch, self.sigma, self.probs = clip, expected_batch, sigma, probs
        self.c = np.asarray(coefficients, dtype=float)
        b = len(self.c)
        self.bands = np.zeros(m, dtype=int) if bands is None else np.asarray(bands, dtype=int) % b
        self.next_clip = clip()
        self.closed = np.zeros(m)  # the sum over closed blocks
        self.past = np.zeros((b - 1, m))  # y_{t-1}, ..., y_{t-b+1}, the latest first (secret: it is noise to undo)
        self.a, self.n = np.zeros(m), np.zeros(m)  # the open block's <v, c_s> and ||c_s||^2 so far
        self.step = 0

    def on_step_end(self, state) -> None:
        scale, self.next_clip = self.expected_batch / self.next_clip, self.clip()
        self.observe(state.updates[BLOCK].detach().reshape(-1).double().cpu().numpy() * scale)

    def observe(self, y: np.ndarray) -> None:
        """Step t's released canary coordinates y_t, in units of C_t / B."""
        t, b, c = self.step, len(self.c), self.c
        whitened = c[0] * y  # (C y)_t = sum_{j < b, j <= t} c_j y_{t-j}
        for j in range(1, min(t, b - 1) + 1):
            whitened = whitened + c[j] * self.past[j - 1]
        if b > 1:
            self.past = np.roll(self.past, 1, axis=0)
            self.past[0] = y
        d = (t - self.bands) % b  # row t is row d of the block of participation step s = t - d
        weight = np.where(d <= t, c[d], 0.0)  # s < 0: no participation yet, nothing to score
        self.a += weight * whitened
        self.n += weight**2
        done = d == b - 1
        if done.any():
            self.closed[done] += audit_bound.block_llr(self.a[done], self.n[done], self.sigma, self.probs)
            self.a[done], self.n[done] = 0.0, 0.0
        self.step += 1

    @property
    def scores(self) -> np.ndarray:
        """Each canary's log-likelihood ratio so far: the closed blocks and the open ones (cut at the last step)."""
        out = self.closed.copy()
        open_ = self.n > 0
        if open_.any():
            out[open_] += audit_bound.block_llr(self.a[open_], self.n[open_], self.sigma, self.probs)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Float64 tensors (checkpoints load with weights_only): the scores are exactly what they were."""
        arrays = {k: torch.from_numpy(getattr(self, k).copy()) for k in ("closed", "past", "a", "n")}
        return {**arrays, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("closed", "past", "a", "n"):
            setattr(self, k, state[k].numpy().copy())
        self.step = int(state["step"])


class CanaryAudit:
    """Everything ``audit=canaries`` adds to a run, in the order run.py uses it."""

    def __init__(self, m: int, train_set: Dataset, significance: float):
        self.m, self.significance = m, significance
        self.dataset = CanaryDataset(train_set, m)
        self.members: np.ndarray | None = None
        self.model: AuditedModel | None = None
        self.observer: WhiteBoxObserver | None = None

    def wrap(self, model: nn.Module, criterion: nn.Module, clip: Callable[[], float]
             ) -> tuple[AuditedModel, AuditedCriterion]:
        """``clip()``: the C of the step being taken (the canaries' gradient norm; adaptive clipping's C_t)."""
        self.model = AuditedModel(model, self.m, self.dataset.template_x.shape)
        return self.model, AuditedCriterion(criterion, self.model, clip)

    def named_parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """The trained parameters by the names callbacks see: the user's own, then the canary block."""
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad] + [(BLOCK, self.model.canaries.weight)]

    def start(self, secret: int, seed: int, clip: Callable[[], float], mechanism: Mechanism,
              coefficients: tuple[float, ...] | None = None) -> WhiteBoxObserver:
        """Draw the membership (the secret is known now) and return the white-box observer, a callback. ``clip()`` is
        the canaries' gradient norm for the next step (``privacy.max_grad_norm``, also when the run is not private;
        C_t with adaptive clipping); ``coefficients``: BandMF's strategy as the noise uses it (None: DP-SGD)."""
        self.members = self.dataset.draw_membership(secret, seed)
        self.probs = audit_bound.multiplicity_probs(mechanism.sample_rate, mechanism.world_size, mechanism.shard_mode)
        self.coefficients, self.bands = coefficients, None
        if coefficients is not None:  # each slot's cyclic part, as the sampler draws it
            from workbench.privacy.cyclic import part_of

            # its position among what the sampler parts: the slot's index, or (user level) its canary user's
            # position, after the data's users (users.py's with_canary_users)
            users = getattr(mechanism, "users", None)
            first = len(users) - self.m if getattr(mechanism, "unit", "example") == "user" else self.dataset.n
            self.bands = part_of(first + np.arange(self.m), len(coefficients))
        sigma = mechanism.gradient_noise_multiplier  # sigma_g with adaptive clipping: the gradient slots' noise
        self.observer = WhiteBoxObserver(self.m, clip, mechanism.expected_batch, sigma, self.probs,
                                         coefficients or (1.0,), self.bands)
        return self.observer

    def users(self, index: UserIndex) -> UserIndex:
        """``privacy.unit=user``: the data's users (of ``self.dataset.base``) and then one canary user per slot, each
        holding its slot alone (workbench/privacy/users.py, with_canary_users)."""
        from workbench.privacy.users import with_canary_users

        return with_canary_users(index, self.dataset.n, self.m)

    def without_canaries(self, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's state dict as an unaudited run's: the block (the last parameter) and its state left out."""
        last = max(i for g in optimizer_state["param_groups"] for i in g["params"])
        groups = [{**g, "params": [i for i in g["params"] if i != last]} for g in optimizer_state["param_groups"]]
        return {"state": {i: s for i, s in optimizer_state["state"].items() if i != last}, "param_groups": groups}

    def state_dict(self, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's private ``audit``: the block, its optimizer state (without_canaries leaves it out of the
        optimizer's) and the observer's state, so that a resumed run audits as an uninterrupted one."""
        last = max(i for g in optimizer_state["param_groups"] for i in g["params"])
        group = next(k for k, g in enumerate(optimizer_state["param_groups"]) if last in g["params"])
        return {"block": self.model.canaries.weight.detach().cpu().clone(), "block_group": group,
                "block_optimizer": optimizer_state["state"].get(last), "observer": self.observer.state_dict()}

    def with_canaries(self, optimizer_state: dict[str, Any], audit_state: dict[str, Any] | None) -> dict[str, Any]:
        """A checkpoint's optimizer state with the block's put back (the inverse of without_canaries)."""
        if not audit_state or "block" not in audit_state:
            raise WorkbenchError("the checkpoint has no audit state (written by a run without audit=canaries?); "
                                 "refusing to resume an audited run from it")
        last = 1 + max(i for g in optimizer_state["param_groups"] for i in g["params"])
        groups = [dict(g, params=list(g["params"])) for g in optimizer_state["param_groups"]]
        groups[audit_state["block_group"]]["params"].append(last)
        state = dict(optimizer_state["state"])
        if audit_state["block_optimizer"] is not None:
            state[last] = audit_state["block_optimizer"]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, audit_state: dict[str, Any], step: int) -> None:
        """After start(): the block and the observer where the checkpoint at ``step`` left them."""
        if audit_state["observer"]["step"] != step:
            raise WorkbenchError(f"the checkpoint's audit state is at step {audit_state['observer']['step']}, "
                                 f"not its step {step}; refusing to resume")
        with torch.no_grad():
            self.model.canaries.weight.copy_(audit_state["block"])
        self.observer.load_state_dict(audit_state["observer"])

    def result(self, reported_epsilon: float | None, delta: float, mechanism: Mechanism,
               steps: int) -> audit_bound.AuditResult:
        final_model = -self.model.canaries.weight.detach().reshape(-1).double().cpu().numpy()
        # blt: the final-model observer alone. Its white-box likelihood ratio (BLT's full Toeplitz whitening, each
        # canary's fixed batch from the secret permutation) is not built; any score gives a valid bound, this one
        # is only weaker. No ideal bound is simulated for it either.
        white_box = getattr(mechanism, "kind", "dpsgd") != "blt"
        scores = {"white_box": self.observer.scores, "final_model": final_model} if white_box else \
            {"final_model": final_model}
        found = audit_bound.audit(scores, self.members, delta, self.significance, reported_epsilon)
        ideal = audit_bound.ideal_lower_bound(self.m, mechanism.sample_rate, mechanism.gradient_noise_multiplier, steps,
                                              mechanism.world_size, mechanism.shard_mode, delta, self.significance,
                                              observers=len(scores), coefficients=self.coefficients, bands=self.bands) \
            if white_box else None
        from dataclasses import replace

        return replace(found, ideal_lower_bound=ideal, unit=getattr(mechanism, "unit", "example"))
