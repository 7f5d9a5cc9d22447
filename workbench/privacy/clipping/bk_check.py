"""Book-keeping's pre-run check, apart from its per-step path (:mod:`workbench.privacy.clipping.book_keeping`).

Before training, on a real batch: how each nn.Embedding is called (ids shared by the batch or batch first), whether the
expansions of shared ids and raw parameters leave the model's losses as they were, and whether each example's row of
bk is that example's own gradient (autograd's gradient of its loss alone). What the check reads is kept on the
strategy (``shared``, raw scalars' ``ones``) for the per-step path; nothing here runs during training.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from workbench.errors import WorkbenchError
from workbench.privacy.clipping.base import LossFn, check_tolerance, require_own

RAW_ONES = (0, 1, 2, 3)  # the 1s a raw parameter's copies may take after the batch dimension (book_keeping._Raw)

def _same(losses: torch.Tensor, plain: torch.Tensor) -> bool:
    """The hooked forward's losses are the model's own (to rounding: the same values reach different kernels)."""
    if losses.shape != plain.shape:
        return False
    tol = check_tolerance(plain.dtype)
    return bool(torch.allclose(losses, plain, rtol=tol, atol=tol * float(plain.abs().max()) if plain.numel() else 0.0))


def _input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["input"]


class PreRunCheck:
    """The pre-run check of :class:`~workbench.privacy.clipping.book_keeping.BookKeeping` (its base): reads the
    strategy's layers, rules and names, runs its forward and backward with every call kept."""

    def _classify(self, batch, loss_fn: LossFn) -> dict[nn.Module, tuple[bool, int]]:
        """How each nn.Embedding is called: (shared, the ids' rank). Shared: its ids' first dimension does not follow
        the batch's, read from forwards (without gradients) of the batch and of the batch less one example, so ids of
        T positions are told from a batch of T examples."""
        if not self.embeddings or not hasattr(batch, "__len__"):
            return {}
        n = len(batch)
        sizes = [n] + ([n - 1] if n > 1 and hasattr(batch, "slice") else [])
        seen: dict[nn.Module, list[set]] = {m: [set(), set()] for m in self.embeddings}

        def hook(i):
            def record(m, args, kwargs):
                ids = _input(args, kwargs)
                if torch.is_tensor(ids):
                    seen[m][i].add((ids.dim(), ids.shape[0] if ids.dim() else None))
            return record

        devices = [p.device for p in self.module.parameters() if p.device.type == "cuda"][:1]
        for i, size in enumerate(sizes):
            handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for m in self.embeddings]
            try:
                with torch.random.fork_rng(devices=devices), torch.no_grad():
                    loss_fn(self.module, batch if size == n else batch.slice(0, size))
            finally:
                for h in handles:
                    h.remove()
        out = {}
        for m, (full, less) in seen.items():
            if not full:
                continue
            follows = all(d > 0 and first == n for d, first in full) and \
                (len(sizes) == 1 or less == {(d, n - 1) for d, _ in full})
            if follows:  # every call batch first (one or several ranks): per example, as bk always read them
                out[m] = (False, None, False)
            elif len(full) == 1 and len({d for d, _ in less}) <= 1:
                rank, first = next(iter(full))
                # a leading 1 at both sizes on ids of rank >= 2 (arange(T).unsqueeze(0)) stands for the batch: decided
                # here, once, never from one call's shape (ids (T,) with T = 1 are not a batch of 1)
                out[m] = (True, rank, rank >= 2 and first == 1 and all(f == 1 for _, f in less))
            else:
                raise WorkbenchError(f"grad_sample_mode=bk: layer {self.layer_names[m]!r} (Embedding) is called with ids "
                                     f"of several shapes {sorted(full)} in one forward, not all batch first; it cannot "
                                     "tell which are shared by the batch")
        return out

    def check(self, batch, loss_fn: LossFn) -> None:
        """On a real batch, in the model's training mode: each example's row of bk must be that example's own gradient
        (autograd's gradient of its loss alone). Time-major inputs, layers or losses that mix examples, and weights
        used outside their layer all fail it; mixing that appears only in larger batches cannot be seen.
        Raw parameters multiply activations of a rank the layers do not say: each one's copies take the fewest 1s of
        ``RAW_ONES`` under which the forward runs with it alone expanded, on the batch and on the batch less one example
        (a batch size equal to a model dimension could broadcast a wrong shape; two sizes in a row almost never do, and
        the check below refuses one that did: its gradients would mix examples)."""
        for h in self.raw:
            h.ones = next((k for k in RAW_ONES if self._fits(h, k, batch, loss_fn)), 0)  # none: refused below
        return self._check(batch, loss_fn)

    def _fits(self, h, ones: int, batch, loss_fn: LossFn) -> bool:
        h.ones = ones
        batches = [batch, batch.slice(0, len(batch) - 1)] if len(batch) > 2 and hasattr(batch, "slice") else [batch]
        devices = [p.device for p in self.module.parameters() if p.device.type == "cuda"][:1]
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                for b in batches:
                    with _reparametrize_module(self.module, {h.full: h.expand(len(b))}):
                        losses = loss_fn(self.module, b)
                    if losses.shape != (len(b),):
                        return False
        except Exception:  # noqa: BLE001 - this shape does not fit what the parameter multiplies
            return False
        return True

    def _check(self, batch, loss_fn: LossFn) -> None:
        was_training = self.module.training
        self.module.train()  # the mode it trains in, whatever mode it was handed over in
        try:
            self.shared = self._classify(batch, loss_fn)
            devices = [p.device for p in self.module.parameters() if p.device.type == "cuda"][:1]
            with torch.random.fork_rng(devices=devices), torch.no_grad():  # the same dropout draws as the forward below
                plain = loss_fn(self.module, batch)
            losses, arrived = self._backward(batch, loss_fn, retain=True, collect=True)
        finally:
            self.module.train(was_training)
        if self._expanded and not _same(losses.detach(), plain):
            # an expansion changed what the model computes (it used the tensor otherwise than by broadcasting)
            raise WorkbenchError(f"grad_sample_mode=bk: expanding {', '.join(sorted(set(self._expanded)))} (shared "
                                 "ids or raw parameters) to one copy per example changes the model's losses")
        layers = {m: calls for m, (_, calls) in arrived.items()}
        n = len(losses)
        params = [p for m in self.layers for p in m.parameters(recurse=False) if p.requires_grad]
        tolerance = check_tolerance(params[0].dtype)
        exact = torch.promote_types(params[0].dtype, torch.float32)
        for k in range(n):
            mine: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # parameter id -> (row k's gradient, its |terms|)
            for m, calls in layers.items():
                calls = [(a.to(exact) if a.is_floating_point() else a, g.to(exact)) for a, g in calls]
                rule = self.rules[m]
                got, magnitude = rule.sample(m, calls, k), rule.sample(m, calls, k, absolute=True)
                for name in got:  # a tied weight: both layers' parts add up
                    key, part = id(getattr(m, name)), (got[name], magnitude[name])
                    mine[key] = (mine[key][0] + part[0], mine[key][1] + part[1]) if key in mine else part
            own = torch.autograd.grad(losses[k], params, retain_graph=True, allow_unused=True)
            for p, ref in zip(params, own):
                ref = torch.zeros(p.shape, device=p.device, dtype=exact) if ref is None else ref.to(exact)
                if ref.is_sparse:  # nn.Embedding(sparse=True)
                    ref = ref.to_dense()
                got, magnitude = mine.get(id(p), (torch.zeros_like(ref), torch.zeros_like(ref)))
                require_own(k, self.names[id(p)], "bk", got, ref, magnitude, tolerance)
        # one example still shows a weight used outside its layer, not mixing: the first larger batch is checked too
        self.checked = n > 1
