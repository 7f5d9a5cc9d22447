"""nn.MultiheadAttention in every form torch accepts, swapped for workbench.models.attention.PerExampleMultiheadAttention: the
same outputs as the original module with the same weights, and per-example gradients equal to the per-example loop."""

import itertools

import pytest
import torch
from torch import nn

from tests.oracle import CLIPPED_RTOL
from workbench.models.attention import PerExampleMultiheadAttention, replace
from workbench.distributed import setup
from workbench.models import prepare_model
from workbench.step import GradientStep

E, H, B, L, S = 8, 2, 3, 5, 4


def _masks(kind, tgt, src, dtype):
    g = torch.Generator().manual_seed(3)
    if kind is None:
        return None
    if kind == "causal":
        return nn.Transformer.generate_square_subsequent_mask(tgt, dtype=dtype)
    if kind == "bool2d":
        m = torch.rand(tgt, src, generator=g) < 0.3
        m[:, 0] = False  # every query keeps one key: no row is all -inf (NaN in both)
        return m
    if kind == "float2d":
        return torch.randn(tgt, src, generator=g, dtype=dtype)
    if kind == "bool3d":
        m = torch.rand(B * H, tgt, src, generator=g) < 0.3
        m[..., 0] = False
        return m
    if kind == "float3d":
        return torch.randn(B * H, tgt, src, generator=g, dtype=dtype)
    raise ValueError(kind)


def _padding(kind, src, dtype):
    if kind is None:
        return None
    m = torch.zeros(B, src, dtype=torch.bool)
    m[1, -2:] = True
    m[2, -1] = True
    return m if kind == "bool" else torch.zeros(B, src, dtype=dtype).masked_fill(m, -1e4)


FORMS = [
    dict(),
    dict(batch_first=True),
    dict(attn_mask="causal", is_causal=True, need_weights=False, self_attention=True),
    dict(attn_mask="causal", is_causal=True, need_weights=True, self_attention=True, batch_first=True),
    dict(attn_mask="bool2d"),
    dict(attn_mask="float2d", batch_first=True),
    dict(attn_mask="bool3d", need_weights=False),
    dict(attn_mask="float3d", average_attn_weights=False),
    dict(key_padding_mask="bool", batch_first=True),
    dict(key_padding_mask="float", attn_mask="float2d", need_weights=False),
    dict(key_padding_mask="bool", attn_mask="bool2d", average_attn_weights=False),
    dict(kdim=6, vdim=3, need_weights=False),
    dict(kdim=6, vdim=3, attn_mask="bool2d"),
    dict(bias=False, batch_first=True),
    dict(add_bias_kv=True, key_padding_mask="bool", attn_mask="float2d"),
    dict(add_zero_attn=True, key_padding_mask="bool", need_weights=False),
    dict(add_bias_kv=True, add_zero_attn=True, bias=False, attn_mask="bool3d", batch_first=True),
    dict(dropout=0.3, attn_mask="causal", is_causal=True, self_attention=True),  # compared in eval mode
    dict(unbatched=True, attn_mask="bool2d"),
    dict(unbatched=True, need_weights=False, key_padding_mask="bool"),
]


def _form_id(form):
    return ",".join(f"{k}={v}" for k, v in form.items()) or "plain"


def _call_args(form, dtype):
    form = dict(form)
    built = {k: form.pop(k) for k in ("batch_first", "kdim", "vdim", "bias", "add_bias_kv", "add_zero_attn", "dropout")
             if k in form}
    self_attention, unbatched = form.pop("self_attention", False), form.pop("unbatched", False)
    src = L if self_attention else S
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, L, E, generator=g, dtype=dtype)
    k = q if self_attention else torch.randn(B, src, built.get("kdim") or E, generator=g, dtype=dtype)
    v = q if self_attention else torch.randn(B, src, built.get("vdim") or E, generator=g, dtype=dtype)
    if not built.get("batch_first"):
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    kwargs = {"attn_mask": _masks(form.pop("attn_mask", None), L, src, dtype),
              "key_padding_mask": _padding(form.pop("key_padding_mask", None), src, dtype), **form}
    if unbatched:  # (L, E): one example, torch's unbatched form
        q, k, v = (t[:, 0] if not built.get("batch_first") else t[0] for t in (q, k, v))
        if kwargs["key_padding_mask"] is not None:
            kwargs["key_padding_mask"] = kwargs["key_padding_mask"][0]
    return built, (q, k, v), kwargs


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_the_swapped_attention_gives_the_original_outputs_and_weights(form):
    dtype = torch.float64
    built, args, kwargs = _call_args(form, dtype)
    torch.manual_seed(0)
    original = nn.MultiheadAttention(E, H, dtype=dtype, **built)
    if built.get("add_bias_kv"):
        nn.init.normal_(original.bias_k), nn.init.normal_(original.bias_v)
    if built.get("bias", True):
        nn.init.normal_(original.in_proj_bias), nn.init.normal_(original.out_proj.bias)
    original.eval()
    swapped = PerExampleMultiheadAttention.from_torch(original)
    assert not swapped.training
    out, weights = original(*args, **kwargs)
    out2, weights2 = swapped(*args, **kwargs)
    torch.testing.assert_close(out2, out)
    if weights is None:
        assert weights2 is None
    else:
        torch.testing.assert_close(weights2, weights)
    # the training-mode forward too (dropout off: the same function; with dropout, each draws its own masks)
    if not built.get("dropout"):
        torch.testing.assert_close(swapped.train()(*args, **kwargs)[0], original.train()(*args, **kwargs)[0])


def test_is_causal_without_a_mask_is_refused_as_torch_refuses_it():
    x = torch.randn(B, L, E)
    for m in (nn.MultiheadAttention(E, H, batch_first=True), PerExampleMultiheadAttention(E, H, batch_first=True)):
        with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
            m(x, x, x, is_causal=True)


def test_frozen_attention_stays_frozen_and_every_weight_is_carried():
    original = nn.MultiheadAttention(E, H, add_bias_kv=True)
    original.in_proj_weight.requires_grad_(False)
    swapped = PerExampleMultiheadAttention.from_torch(original)
    assert [p.requires_grad for p in (swapped.q_proj.weight, swapped.k_proj.weight, swapped.v_proj.weight)] == [False] * 3
    assert swapped.q_proj.bias.requires_grad and swapped.bias_k.weight.requires_grad
    assert sum(p.numel() for p in swapped.parameters()) == sum(p.numel() for p in original.parameters())


class GPTBlock(nn.Module):
    """A GPT block as tutorials write it: nn.TransformerEncoderLayer with a causal mask, learned positions."""

    def __init__(self, vocab=11, d=16, heads=2, t=6, shared_positions=False, norm_first=False, padding=False):
        super().__init__()
        self.t, self.shared, self.padding = t, shared_positions, padding
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.block = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True,
                                                                      norm_first=norm_first), 2)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        b, t = ids.shape
        positions = torch.arange(t, device=ids.device)
        h = self.tok(ids) + self.pos(positions if self.shared else positions.expand(b, t))
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        pad = ids == 0 if self.padding else None
        return self.head(self.block(h, mask=mask, is_causal=True, src_key_padding_mask=pad).mean(1))


class Seq2Seq(nn.Module):
    """nn.TransformerDecoderLayer, not batch first: causal self-attention, cross-attention with a memory padding mask."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.src, self.tgt = nn.Linear(3, d), nn.Linear(3, d)
        self.dec = nn.TransformerDecoderLayer(d, heads, 2 * d, dropout=0.0)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = x.view(len(x), 2, 4, 3).transpose(0, 2)  # (4 steps, 2, B, 3): time-major, as batch_first=False wants
        memory, target = self.src(x[:, 0]), self.tgt(x[:, 1])
        mask = nn.Transformer.generate_square_subsequent_mask(4)
        pad = torch.zeros(x.shape[2], 4, dtype=torch.bool)
        pad[:, -1] = True
        out = self.dec(target, memory, tgt_mask=mask, tgt_is_causal=True, memory_key_padding_mask=pad)
        return self.head(out.mean(0))


def _ids(n=9, t=6):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 11, (n, t), generator=g)
    ids[1, -2:] = 0
    return ids


@pytest.mark.parametrize("make, x, mode", [(lambda: GPTBlock(), _ids(), "bk"),
                                           (lambda: GPTBlock(norm_first=True), _ids(), "bk"),
                                           (lambda: GPTBlock(padding=True), _ids(), "bk"),
                                           (Seq2Seq, torch.randn(9, 24), "vmap")],
                         ids=["gpt", "gpt-pre-ln", "gpt-padding", "seq2seq"])
def test_transformer_layers_with_masks_keep_their_function_and_clip_exactly(make, x, mode):
    """Swapped in by prepare_model: the same outputs in training and in eval mode (where the original takes torch's
    fast path), and the clipped sum of the auto-chosen mode equals the float64 per-example loop. A time-major
    (batch_first=False) layer's Linears see (T, B, d): no per-layer rule applies, the whole-model route does."""
    torch.manual_seed(0)
    original = make()
    fixed, notes = prepare_model(make_copy(original), private=True)
    assert notes and all("MultiheadAttention -> PerExampleMultiheadAttention (weights carried)" in n for n in notes)
    torch.testing.assert_close(fixed.train()(x), original.train()(x))
    with torch.no_grad():
        torch.testing.assert_close(fixed.eval()(x), original.eval()(x), atol=1e-5, rtol=1e-4)
    fixed.train()
    y = torch.randint(0, 4, (len(x),))
    step = GradientStep(fixed, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=0.1,
                        noise_multiplier=0.0, grad_sample_mode="auto", max_physical_batch_size=4)
    step.check((x[:8], y[:8]))
    assert step.mode == mode, step.mode_note  # bk: every layer is a Linear, an Embedding or a LayerNorm
    step((x, y), step=0)
    expected = _clipped_sum_loop(fixed, x, y, 0.1)
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-7)


def make_copy(model):
    import copy

    return copy.deepcopy(model)


def _clipped_sum_loop(model, x, y, clip):
    model = make_copy(model).double()
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(y)):
        xi = x[i:i + 1].double() if x.is_floating_point() else x[i:i + 1]
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(xi), y[i:i + 1]), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        for t, g in zip(total, grads):
            t += min(1.0, clip / (norm + 1e-6)) * g
    return total


@pytest.mark.parametrize("mode", ["bk", "hooks", "ew", "vmap"])
def test_every_mode_clips_the_swapped_attention_exactly(mode):
    """add_bias_kv (its biases as per-example Embedding lookups), add_zero_attn, kdim/vdim and a key padding mask."""

    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True, kdim=5, vdim=3,
                                              batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            q, k, v = x[:, :24].view(len(x), 3, 8), x[:, 24:44].view(len(x), 4, 5), x[:, 44:56].view(len(x), 4, 3)
            pad = torch.zeros(len(x), 4, dtype=torch.bool)
            pad[:, 0] = True
            return self.head(self.attn(q, k, v, key_padding_mask=pad)[0].mean(1))

    torch.manual_seed(0)
    model, notes = prepare_model(Cross(), private=True)
    assert notes == ["attn: MultiheadAttention -> PerExampleMultiheadAttention (weights carried)"]
    x, y = torch.randn(7, 56), torch.randint(0, 3, (7,))
    expected = _clipped_sum_loop(model, x, y, 0.1)
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=0.1,
                        noise_multiplier=0.0, grad_sample_mode=mode, max_physical_batch_size=4)
    step.check((x, y))
    step((x, y), step=0)
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-7)


class _Batched:
    """A loss_fn for BookKeeping called directly: the (ids, labels) batch with a length, as GradientStep's Batch."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)


def _ce(model, b):
    return nn.functional.cross_entropy(model(b.x), b.y, reduction="none")


@pytest.mark.parametrize("padding", [False, True], ids=["plain", "padded"])
def test_shared_position_ids_in_a_gpt_block_clip_exactly_in_book_keeping(padding):
    """pos(torch.arange(T)): ids without the batch dimension, expanded by bk to one copy per example. auto picks bk;
    each example's gradient of the position table is the oracle's (its own loss alone, float64); the clipped sum of
    9 examples in micro-batches of 4, 4 and 1 (one of them padded) is the oracle's."""
    from tests.oracle import clipped_sum, rows
    from workbench.privacy.clipping.book_keeping import BookKeeping

    torch.manual_seed(0)
    model, _ = prepare_model(GPTBlock(shared_positions=True, padding=padding), private=True)
    x, y = _ids(), torch.randint(0, 11, (9,))
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=0.1,
                        noise_multiplier=0.0, grad_sample_mode="auto", max_physical_batch_size=4)
    step.check((x[:8], y[:8]))
    assert step.mode == "bk" and step.mode_note == "grad_sample_mode=auto: bk", step.mode_note
    assert step.clipper.shared == {model.pos: (True, 1, False), model.tok: (False, None, False)}  # no leading 1
    expected = clipped_sum(model, rows(x, y), 0.1)
    assert expected.clipped >= 3  # the clip bites
    step((x, y), step=0)
    for p, e in zip(step.params, expected.grads):
        torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-7)
    # each example's own gradient of the shared table, as bk forms it, against the oracle's (no clipping)
    bk = BookKeeping(model, 1.0)
    bk.check(_Batched(x, y), _ce)
    _, arrived = bk._backward(_Batched(x, y), _ce, retain=False, collect=True)
    rule, calls = bk.rules[model.pos], arrived[model.pos][1]
    assert [tuple(a.shape) for a, _ in calls] == [(9, 6)]  # expanded: one copy of the ids per example
    where = next(i for i, p in enumerate(q for q in model.parameters() if q.requires_grad) if p is model.pos.weight)
    for k in range(9):
        own = clipped_sum(model, rows(x[k:k + 1], y[k:k + 1]), float("inf")).grads
        mine = rule.sample(model.pos, [(a.double(), g.double()) if a.is_floating_point() else (a, g.double())
                                       for a, g in calls], k)["weight"]
        torch.testing.assert_close(mine, own[where], rtol=1e-5, atol=1e-7)


def test_shared_ids_are_told_from_a_batch_as_long_and_an_expansion_that_changes_the_function_leaves_bk():
    """A check batch as long as the sequence (ids (T,) for T examples) is still told shared (the check also looks at
    the batch less one example): bk. An output used otherwise than by broadcasting (summed over positions) would change
    the losses if expanded: bk is refused and auto falls to vmap. Both the oracle's clipped sum."""

    class Summed(GPTBlock):
        def forward(self, ids):
            h = self.tok(ids) + self.pos(torch.arange(ids.shape[1])).sum(0)  # (d,): every position's row
            return self.head(self.block(h).mean(1))

    x, y = _ids(), torch.randint(0, 11, (9,))
    for make, check, mode in ((lambda: GPTBlock(shared_positions=True), 6, "bk"), (lambda: Summed(), 8, "vmap")):
        torch.manual_seed(0)
        model, _ = prepare_model(make(), private=True)
        step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=0.1,
                            noise_multiplier=0.0, grad_sample_mode="auto", max_physical_batch_size=4)
        step.check((x[:check], y[:check]))
        assert step.mode == mode, step.mode_note
        if mode == "vmap":
            assert "bk" in step.mode_note and "model.pos (Embedding)" in step.mode_note, step.mode_note
        step((x, y), step=0)
        for p, e in zip(step.params, _clipped_sum_loop(model, x, y, 0.1)):
            torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-7)


def test_replace_leaves_subclasses_to_opacus_and_turns_off_nested_tensors():
    class Mine(nn.MultiheadAttention):
        pass

    model = nn.ModuleDict({"a": Mine(4, 2), "enc": nn.TransformerEncoder(nn.TransformerEncoderLayer(4, 2,
                                                                                                   batch_first=True), 1)})
    assert model["enc"].use_nested_tensor
    notes = replace(model)
    assert notes == ["enc.layers.0.self_attn: MultiheadAttention -> PerExampleMultiheadAttention (weights carried)"]
    assert type(model["a"]) is Mine and not model["enc"].use_nested_tensor
