"""Book-keeping per-sample clipping (Bu et al., 2023): one forward, one backward, no weight gradients of the batch.

The forward keeps each trainable layer's input a; one backward computes the gradient g = dL/dz at each layer output z
and no weight gradient. Each layer's rule (:mod:`workbench.privacy.clipping.layers`: Linear, Embedding, Conv1d/2d,
LayerNorm/RMSNorm, GroupNorm, Hugging Face's Conv1D; biases and frozen parameters included) takes, per call, whichever
route holds less memory: its per-sample gradients, formed as g arrives (a tap -- an identity autograd node -- on z
hands g over during the backward, and a and g are let go), or (a, g) kept, the backward returning g. Then per-sample
squared norms per layer, their sum over layers, the clip factors f_i, and sum_i f_i grad_i into the buffer. A layer
called more than once (or on a sequence (B, T, d)) is exact: its calls are summed per example before norms. Two things
cut the small ops a step costs (on a small ViT they weigh as much as the kernels): formed per-sample gradients of few
entries per example (normalisation weights, biases, raw parameters) are stacked into one tensor, one norm reduction and
one matrix-vector product for all (``bound.stack_small``), and kept Linear sequences that read one and the same input
tensor (self-attention's q, k and v projections) are joined into one Linear (``layers.JoinedLinears``: the input's
norms, Gram matrices and scaled copy computed once). Each layer's route is decided once per per-example shape
(:meth:`BookKeeping._keeps`), and a rule may read what the forward saved for autograd (LayerNorm's mean and 1/std,
``rules[m].saved``) instead of recomputing it during the backward.

It relies on what every per-sample mode relies on -- a layer's input rows are examples, one loss per example -- and on
seeing every use of a weight. :meth:`BookKeeping.check` verifies this on a real batch before training.

Shared ids (learned positions looked up with ``torch.arange(T)``): an nn.Embedding called on ids without the batch
dimension gives an output every example reads by broadcasting, and its batched output gradient is the sum over the
examples. Book-keeping calls such a layer on the ids expanded to (B, *ids.shape) instead, or (B, T) for ids (1, T)
whose 1 the pre-run check saw stand for the batch (nanoGPT's ``arange(T).unsqueeze(0)``) (a forward pre-hook, present
only during its own forwards): the same rows, one copy per example, so the broadcast that follows is elementwise and
every value downstream is the same, while each example's copy now receives that example's own output gradient, so the
Embedding rule is exact on it. Which layers are called so is read once, by the pre-run check (ids whose first
dimension is not the batch's); the check also requires the losses to be those of the model's own forward, so an
expansion that would change what the model computes is refused, never trained.

Tied weights (an Embedding sharing its weight with a Linear: GPT-2's token embedding and LM head) are clipped as one
unit, both layers' calls kept, their joint norm with its cross term: :mod:`workbench.privacy.clipping.tied`.

Raw parameters (a ViT's cls token and position table, nn.Parameters of the user's own module read by broadcasting)
are expanded alike, one copy per example, and tapped as a layer output: each copy's gradient is its example's
gradient of the parameter (:class:`_Raw`), formed per example and clipped as other formed gradients are.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from workbench.privacy.clipping.base import LossFn, Strategy
from workbench.privacy.clipping.bk_check import PreRunCheck, _input
from workbench.privacy.clipping.bound import (add_exact, clip_factors, exact_float32, materialised, stack_small,
                                               zero_rows)
from workbench.privacy.clipping.layers import (RULES, EmbeddingRule, JoinedLinearRule, JoinedLinears, LinearRule,
                                                precise, rule_for, trainable, weighted_sum)
from workbench.privacy.clipping.rows import LinearRows
from workbench.privacy.clipping.tied import TiedPair, tie, tied_pairs
from workbench.errors import WorkbenchError


JOINED = JoinedLinearRule()


class _Tap(torch.autograd.Function):
    """The identity on a layer's output; its backward hands the output's gradient to ``sink`` (once: a retained graph
    replays it without). The output shares the input's storage and version counter but is no view of it, so a later
    in-place op on it (ReLU(inplace=True)) stays legal."""

    @staticmethod
    def forward(ctx, z, anchor, sink):
        ctx.sink = sink
        return z.detach()

    @staticmethod
    def backward(ctx, g):
        sink, ctx.sink = ctx.sink, None  # let go of the layer input it holds
        if sink is not None:
            sink(g)
        return g, None, None


def trainable_layers(model: nn.Module) -> list[nn.Module]:
    """The modules with trainable parameters of their own. A parameter that a module without a rule registers beside a
    layer with a rule is the layer's: the module only holds a second reference (Hugging Face's BERT masked-LM head,
    ``self.decoder.bias = self.bias``); book-keeping hides it from that module during its forwards
    (:meth:`BookKeeping._run`), so a use of it outside the layer is refused, not missed."""
    mods = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    with_rule = {m for m in mods if rule_for(m)[0] is not None}
    ruled = _ruled_parameters(with_rule)
    return [m for m in mods if m in with_rule
            or any(p.requires_grad and id(p) not in ruled for p in m.parameters(recurse=False))]


def _ruled_parameters(layers) -> set[int]:
    """ids of the parameters that these layers with a rule register."""
    return {id(p) for m in layers for p in m.parameters(recurse=False)}


def raw_owner(m: nn.Module) -> bool:
    """A module of the user's own (not torch's, no layer with a rule) whose own trainable parameters are raw: a cls
    token, a position table, a layer-scale gamma, read by broadcasting over the batch (see :class:`_Raw`)."""
    return rule_for(m)[0] is None and not type(m).__module__.startswith("torch.") \
        and not isinstance(m, tuple(RULES)) and not isinstance(m, torch.nn.modules.lazy.LazyModuleMixin)


class _Raw:
    """One raw parameter as book-keeping's "layer": during its forwards the parameter p is replaced by p expanded to
    one copy per example, (B, 1, ..., 1, *p.shape) with ``ones`` 1s (a leading dimension of 1 taken as the batch's:
    a cls token (1, 1, d) -> (B, 1, d)), so an op that broadcast it over the batch is elementwise, every value the
    same, and the gradient of copy i is example i's own gradient of p. The 1s line the copy up with what it multiplies:
    a LayerScale gamma (d,) on (B, T, d) activations takes one, a ConvNeXt gamma on (B, H, W, d) two, a ReZero alpha ()
    on (B, d) one; the pre-run check finds them (bk_check.RAW_ONES). It also requires the losses to be the model's
    own and every example's gradient to be autograd's: a parameter used otherwise (a matmul weight, a slice, a sum)
    is refused, never trained."""

    def __init__(self, owner: nn.Module, name: str, full: str):
        self.owner, self.name, self.full = owner, name, full
        self.weight = getattr(owner, name)
        self.ones = 0

    def expand(self, n: int) -> torch.Tensor:
        p = self.weight
        shape = p.shape[1:] if p.dim() and p.shape[0] == 1 else p.shape
        return p.expand(n, *[1] * self.ones, *shape)


class RawRule:
    """Per-sample gradients of a raw parameter: the gradient of example i's copy, (n, *p.shape), always formed."""

    @staticmethod
    def per_sample(h: _Raw, a, g):
        return {"weight": precise(g).reshape(len(g), *h.weight.shape)}

    @staticmethod
    def sample(h: _Raw, calls, k, absolute=False):
        out = sum(g[k] for _, g in calls).reshape(h.weight.shape)
        return {"weight": out.abs() if absolute else out}


def refusal(layers: list[nn.Module], raw: bool = True) -> str | None:
    """Why book-keeping cannot clip these layers (None: it can); ``raw``: modules of the user's own whose parameters
    are raw count as clipped (:class:`_Raw`, checked on real examples before training)."""
    for m in layers:
        _, why = rule_for(m)
        if why and not (raw and raw_owner(m)):
            return why
    return tied_pairs(layers)[1]  # a shared weight other than an Embedding's tied to a Linear


class BookKeeping(PreRunCheck, Strategy):
    """grad_sample_mode=bk."""

    def __init__(self, model: nn.Module, clip: float):
        self.module, self.clip = model, clip
        self.layers = trainable_layers(model)
        why = refusal(self.layers)
        if why:
            raise WorkbenchError(f"grad_sample_mode=bk {why}: use grad_sample_mode=auto")
        self.rules = {m: rule_for(m)[0] for m in self.layers}
        names = {m: n for n, m in model.named_modules()}
        ruled = _ruled_parameters(m for m in self.layers if self.rules[m] is not None)
        self.raw = [_Raw(m, k, f"{names[m]}.{k}".lstrip(".")) for m in self.layers if self.rules[m] is None
                    for k, p in m.named_parameters(recurse=False) if p.requires_grad and id(p) not in ruled]
        self.rules.update({h: RawRule() for h in self.raw})
        # those second references: hidden from their modules during bk's forwards, so that a use of one outside the
        # layer (which the layer's rule would not see) fails loudly instead of clipping a gradient that misses it
        self.aliases = [(m, k) for m in model.modules() if self.rules.get(m) is None
                        for k, p in m._parameters.items() if p is not None and p.requires_grad and id(p) in ruled]
        self.hooked = [m for m in self.layers if self.rules[m] is not None]
        # tied weights (an Embedding and a Linear sharing one): both layers always keep their calls, clipped as one
        self.tied: dict[nn.Module, TiedPair] = {}
        for e, lin in tied_pairs(self.layers)[0]:
            self.tied[e] = self.tied[lin] = TiedPair(e, lin)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.layer_names = {m: n for n, m in model.named_modules()} | {h: h.full for h in self.raw}
        self.checked = False
        # nn.Embedding layers and their ids' rank, as the pre-run check saw them called: shared ids (True) or batch first
        self.embeddings = {m for m in self.hooked if isinstance(self.rules[m], EmbeddingRule)}
        self.shared: dict[nn.Module, tuple[bool, int, bool]] | None = None  # (shared, rank, leading 1 is the batch)
        self._anchor = torch.zeros((), requires_grad=True)  # the leaf the backward is asked for: only taps reach it
        self._expanded: list[str] = []  # what the last forward expanded per example: shared ids, raw parameters
        self._arrived: dict | None = None  # during a backward: layer -> [per-sample gradients or None, kept calls]
        self._n = 0
        self._joins: dict[tuple, JoinedLinears] = {}  # Linear layers that read one input, joined (see _join)
        self._routes: dict[tuple, bool] = {}  # (layer, per-example shapes...) -> the rule keeps a and g (_keeps)
        # rules that read what the forward saved for the backward (LayerNorm's statistics) instead of recomputing it
        self.saved = {m: self.rules[m].saved for m in self.hooked if hasattr(self.rules[m], "saved")}
        self.lean = LinearRows() if not self.raw and LinearRows.fits(self.hooked, self.rules) else None

    def _run(self, batch, loss_fn: LossFn, collect: bool):
        """Forward with the recording hooks. A call whose rule keeps (a, g) (all calls when ``collect``: the check
        reads them) is recorded with its output's autograd edge, for the backward to return its g; the others get a
        tap, which forms their per-sample gradients during the backward. Returns the per-example losses and the kept
        calls (layer, a, edge)."""
        kept: list[tuple[nn.Module, torch.Tensor, object]] = []
        taps = 0
        n = len(batch) if hasattr(batch, "__len__") else None
        expanded = []

        def broadcast(m, args, kwargs):
            """Shared ids (no batch dimension) expanded to one copy per example: see the module docstring."""
            ids = _input(args, kwargs)
            if n is None or not torch.is_tensor(ids):
                return None
            known = (self.shared or {}).get(m)
            if known is None:  # not seen by the check: ids whose first dimension is not the batch's
                shared, lead = ids.dim() == 0 or ids.shape[0] != n, False
            elif known[0] and (known[1] != ids.dim() or known[2] and ids.shape[0] != 1):
                raise WorkbenchError(f"grad_sample_mode=bk: layer {self.layer_names[m]!r} (Embedding) got ids of shape "
                                     f"{tuple(ids.shape)} for a batch of {n}, not of the shape the pre-run check saw")
            else:
                shared, lead = known[0], known[2]
            if not shared:
                return None
            expanded.append(m)
            # lead: the check saw a leading 1 (nanoGPT's arange(T).unsqueeze(0)) standing for the batch
            ids = ids.expand(n, *ids.shape[1:] if lead else ids.shape).contiguous()
            return ((ids, *args[1:]), kwargs) if args else (args, {**kwargs, "input": ids})

        def record(m, args, kwargs, out):
            nonlocal taps
            if not out.requires_grad:
                raise WorkbenchError("grad_sample_mode=bk: gradients are disabled in the model's forward (no_grad?)")
            a = _input(args, kwargs).detach()
            if collect or m in self.tied or (self.lean and a.dim() == 2) or self._keeps(m, a, out):  # (lean: rows kept)
                kept.append((m, a, get_gradient_edge(out)))
                return None
            taps += 1
            saved = self.saved[m](m, a, out) if m in self.saved else None
            return _Tap.apply(out, self._anchor, functools.partial(self._arrive, m, a, saved))

        handles = [m.register_forward_pre_hook(broadcast, with_kwargs=True) for m in self.embeddings if self.shared != {}]
        handles += [m.register_forward_hook(record, with_kwargs=True) for m in self.hooked]
        raw = {}
        if self.raw and n is not None:  # raw parameters: one copy per example, tapped as a layer output (see _Raw)
            dummy = torch.empty(n, 0)
            for h in self.raw:
                z = h.expand(n)
                if collect:
                    kept.append((h, dummy, get_gradient_edge(z)))
                else:
                    taps += 1
                    z = _Tap.apply(z, self._anchor, functools.partial(self._arrive, h, dummy, None))
                raw[h] = z
            expanded.extend(self.raw)
        # each raw parameter's copies stand in its owner's place for this forward: a plain swap (one owner, one
        # name: shared parameters are refused), not torch's general _reparametrize_module (~0.3 ms a step on vit)
        for h, z in raw.items():
            h.owner._parameters[h.name] = z
        hidden = [(m, m._parameters) for m, _ in self.aliases]
        for m, k in self.aliases:  # a new dict without the reference; the module's own, in its order, comes back after
            m.__dict__["_parameters"] = {name: p for name, p in m._parameters.items() if name != k}
        try:
            losses = loss_fn(self.module, batch)
        except WorkbenchError:
            raise
        except Exception as e:
            if hidden and isinstance(e, AttributeError):
                where = ", ".join(f"{self.layer_names[m]}.{k}".lstrip(".") for m, k in self.aliases)
                raise WorkbenchError(f"grad_sample_mode=bk: the model uses {where}, a second reference to a layer's "
                                     f"parameter, outside that layer: bk cannot clip that use ({e})") from e
            if not expanded:
                raise
            # an expansion the model's code cannot take (e.g. it reshapes the output): bk cannot clip it exactly
            what = "raw parameter" if isinstance(expanded[0], _Raw) else "the ids shared by the batch of layer"
            raise WorkbenchError(f"grad_sample_mode=bk cannot expand {what} "
                                 f"{self.layer_names[expanded[0]]!r} to one copy per example: "
                                 f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from e
        finally:
            for m, params in hidden:
                m.__dict__["_parameters"] = params
            for h in raw:
                h.owner._parameters[h.name] = h.weight
            for h in handles:
                h.remove()
        self._expanded = [self.layer_names[m] for m in expanded]
        if not kept and not taps:
            raise WorkbenchError("grad_sample_mode=bk: no trainable layer ran in the model's forward")
        return losses, kept, taps

    def _batch_first(self, m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> None:
        if a.shape[0] != self._n or g.shape[0] != self._n:
            raise WorkbenchError(f"grad_sample_mode=bk needs each layer's input to keep the batch as dim 0: "
                                 f"layer {self.layer_names[m]!r} ({type(m).__name__}) got {tuple(a.shape)} for a "
                                 f"batch of {self._n} (flattened or time-major?); reshape it to (batch, ..., features)")

    def _keeps(self, m: nn.Module, a: torch.Tensor, out: torch.Tensor) -> bool:
        """The rule's route for this call (keep a and g, or form per-sample gradients), decided once per layer and
        per-example shapes (public; every rule's choice depends on nothing else), not on every call."""
        key = (m, a.shape[1:], out.shape[1:], a.dtype)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self.rules[m].keeps(m, a, out)
        return route

    def _arrive(self, m: nn.Module, a: torch.Tensor, saved, g: torch.Tensor) -> None:
        """A tapped call's g, during the backward: its per-sample gradients, added to the layer's (``saved``: what
        the forward kept for the rule, e.g. LayerNorm's statistics, or None)."""
        if self._arrived is None:
            return
        self._batch_first(m, a, g)
        entry = self._arrived.get(m)
        if entry is None:
            entry = self._arrived[m] = [None, []]
        grads = self.rules[m].per_sample(m, a, g) if saved is None else self.rules[m].per_sample(m, a, g, saved=saved)
        if entry[0] is None:
            entry[0] = grads
        else:  # a reused layer: its calls' per-sample gradients add up
            for name, t in grads.items():
                entry[0][name].add_(t)

    def _backward(self, batch, loss_fn: LossFn, retain: bool, collect: bool):
        """The forward and the one backward; returns the losses and, per layer, [per-sample gradients or None, kept
        calls (a, g)]."""
        losses, kept, taps = self._run(batch, loss_fn, collect)
        self._arrived, self._n = {}, len(losses)
        try:
            if losses.requires_grad:
                edges = [edge for _, _, edge in kept] + ([get_gradient_edge(self._anchor)] if taps else [])
                grads = torch.autograd.grad(losses.sum(), edges, retain_graph=retain, allow_unused=True)
                for (m, a, _), g in zip(kept, grads):
                    if g is not None:  # None: this output did not reach the loss
                        self._batch_first(m, a, g)
                        self._arrived.setdefault(m, [None, []])[1].append((a, g))
            return losses, self._arrived
        finally:
            self._arrived = None

    def accumulate(self, batch, loss_fn: LossFn, view_of: dict[int, torch.Tensor]) -> torch.Tensor:
        """Add the micro-batch's clipped gradient sum into ``view_of`` (parameter id -> gradient buffer view). Not
        checked here: GradientStep checks before training, or the micro-batch first while ``checked`` is False, in the
        parameters' precision (``loss_fn`` here may autocast, which the check's comparison with autograd cannot).
        Each example's contribution as added is at most C (1 + RHO): :mod:`workbench.privacy.clipping.bound`."""
        losses, arrived = self._backward(batch, loss_fn, retain=False, collect=False)
        n = len(losses)
        bound_n = max(n, self.max_batch)  # public: no factor depends on how many examples were drawn
        with exact_float32(losses.device):
            factor = self.lean.add(arrived, bound_n, self.clip, view_of) if self.lean and arrived else None
            if factor is not None:  # Linear layers on float32 rows: the generic path's computation, lean (rows.py)
                self.count(factor)  # adaptive clipping only
                return losses.detach()
            parts = []  # a certified bound per layer route, summed once
            kept, formed = [], []
            for m, (per_sample, calls) in arrived.items():
                rule = self.rules[m]
                if per_sample is not None:
                    for a, g in calls:  # a layer whose calls took both routes: all per-sample
                        for name, t in rule.per_sample(m, a, g).items():
                            per_sample[name].add_(t)
                    formed += [(id(getattr(m, name)), t) for name, t in per_sample.items()]
                elif calls:
                    kept.append((rule, m, calls))
            formed = stack_small(formed, n)
            kept = tie(kept, self.tied)
            parts += [materialised(t, bound_n) for _, t in formed]
            kept = self._join(kept)
            for i, (rule, m, calls) in enumerate(kept):
                state = rule.prepare(m, calls, n)
                parts.append(rule.bound(m, state, n, bound_n))
                kept[i] = (rule, m, calls, state)
            buffer = next(iter(view_of.values())).dtype
            factor, rows = clip_factors(parts, n, self.clip, buffer, losses.device)
            # rows: examples recomputed alone in float64 (non-finite or extreme bounds); zeroed here, as 0 * inf is NaN
            for key, t in formed:
                t = t if rows is None else zero_rows(t, rows)
                total = weighted_sum(t, factor.to(t.dtype))  # in float32 at least, cast when added
                if isinstance(key, int):
                    view_of[key].add_(total)
                else:  # stacked small tensors: each parameter's own entries of the one sum
                    for k, part in zip(key, total.split([view_of[k].numel() for k in key])):
                        view_of[k].add_(part.view(view_of[k].shape))
            for rule, m, calls, state in kept:
                if rows is not None:  # both a and g: either may hold the inf
                    state = rule.prepare(m, [(zero_rows(a, rows), zero_rows(g, rows)) for a, g in calls], n)
                rule.add_clipped(m, state, factor, view_of)
        exact = [] if rows is None else [add_exact(self._exact_gradient(arrived, k), self.clip, view_of)
                                         for k in rows.nonzero().flatten().tolist()]
        self.count(factor, exact)  # adaptive clipping only
        return losses.detach()

    def _join(self, kept: list) -> list:
        """The kept calls (rule, layer, calls), with Linear sequences that read one and the same input tensor, each
        once (self-attention's q, k and v projections), joined into one :class:`JoinedLinears`."""
        groups: dict[tuple, list[int]] = {}
        for i, (rule, m, calls) in enumerate(kept):
            a = calls[0][0]
            # the same memory, saved by autograd for the weight's gradient (an in-place change fails the backward):
            # the same values
            if type(rule) is LinearRule and len(calls) == 1 and a.dim() > 2 and "weight" in trainable(m) \
                    and m not in self.tied:
                groups.setdefault((a.data_ptr(), a.shape, a.stride(), a.dtype, a.device, tuple(trainable(m))),
                                  []).append(i)
        first = {members[0]: members for members in groups.values() if len(members) > 1}
        if not first:
            return kept
        rest = {i for members in first.values() for i in members[1:]}
        out = []
        for i, unit in enumerate(kept):
            if i in first:
                layers = tuple(kept[k][1] for k in first[i])
                joined = self._joins.get(layers) or self._joins.setdefault(layers, JoinedLinears(layers))
                out.append((JOINED, joined, [kept[k][2][0] for k in first[i]]))
            elif i not in rest:
                out.append(unit)
        return out

    def _exact_gradient(self, arrived, k: int) -> dict[int, torch.Tensor]:
        """Example k's gradient in float64 (parameter id -> tensor): formed per-sample gradients as they are (what
        the batch path would have summed), kept calls by the rule's own per-example route on float64 inputs."""
        out: dict[int, torch.Tensor] = {}
        for m, (per_sample, calls) in arrived.items():
            if per_sample is not None:
                grads = {name: t[k].double() for name, t in per_sample.items()}
            elif calls:
                one = [(a[k:k + 1].double() if a.is_floating_point() else a[k:k + 1], g[k:k + 1].double())
                       for a, g in calls]
                grads = self.rules[m].sample(m, one, 0)
            else:
                continue
            for name, t in grads.items():  # a tied weight: both layers' parts add up
                key = id(getattr(m, name))
                out[key] = out[key] + t if key in out else t
        return out
