"""``nn.MultiheadAttention`` for DP-SGD: the same function, built from layers every clipping mode has a rule for.

:class:`PerExampleMultiheadAttention` computes what ``nn.MultiheadAttention`` computes, in every form torch accepts
(``batch_first`` either way, unbatched inputs, ``attn_mask`` bool or float, 2-D or 3-D, ``is_causal``,
``key_padding_mask``, ``need_weights`` with ``average_attn_weights``, ``kdim``/``vdim``, ``bias=False``,
``add_bias_kv``, ``add_zero_attn``, dropout), with its projections as four ``nn.Linear`` layers fed batch first and
``add_bias_kv``'s biases as one-row ``nn.Embedding`` layers looked up once per example, so book-keeping, Opacus' hooks
and expanded weights all see every use of every weight. :func:`replace` swaps it in with the original's weights (the
in-projection split into q, k and v), so the swapped model gives the original's outputs.

``nn.TransformerEncoderLayer``/``DecoderLayer`` call ``self_attn(x, x, x, attn_mask=..., key_padding_mask=...,
need_weights=False, is_causal=...)`` and take ``[0]``: the same call here. Their inference fast path (and
``nn.TransformerEncoder``'s nested tensors) read the fused ``in_proj_weight``; this module has none
(``_qkv_same_embed_dim`` is False, ``in_proj_bias`` None), so they take their ordinary path, which calls it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class PerExampleMultiheadAttention(nn.Module):
    """Drop-in for ``nn.MultiheadAttention`` (same arguments, same forward); see the module docstring."""

    _qkv_same_embed_dim = False  # what the transformer layers' fast path reads: never taken here
    in_proj_weight = None
    in_proj_bias = None

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        f = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.head_dim = embed_dim // num_heads
        self.add_zero_attn = add_zero_attn
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias, **f)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias, **f)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias, **f)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias, **f)
        # add_bias_kv: one learned key and value appended to every example's keys, looked up per example
        self.bias_k = nn.Embedding(1, embed_dim, **f) if add_bias_kv else None
        self.bias_v = nn.Embedding(1, embed_dim, **f) if add_bias_kv else None

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> "PerExampleMultiheadAttention":
        """The same attention as ``m``, its weights (and which of them train) copied."""
        w = m.out_proj.weight
        new = cls(m.embed_dim, m.num_heads, m.dropout, m.in_proj_bias is not None, m.bias_k is not None,
                  m.add_zero_attn, m.kdim, m.vdim, m.batch_first, device=w.device, dtype=w.dtype)
        e = m.embed_dim
        if m._qkv_same_embed_dim:
            weights = [(m.in_proj_weight, m.in_proj_weight[i * e:(i + 1) * e]) for i in range(3)]
        else:
            weights = [(p, p) for p in (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)]
        projections = (new.q_proj, new.k_proj, new.v_proj)
        with torch.no_grad():
            for layer, (source, w) in zip(projections, weights):
                layer.weight.copy_(w)
                layer.weight.requires_grad_(source.requires_grad)
            if m.in_proj_bias is not None:
                for i, layer in enumerate(projections):
                    layer.bias.copy_(m.in_proj_bias[i * e:(i + 1) * e])
                    layer.bias.requires_grad_(m.in_proj_bias.requires_grad)
            for name in ("weight", "bias"):
                source = getattr(m.out_proj, name)
                if source is not None:
                    getattr(new.out_proj, name).copy_(source)
                    getattr(new.out_proj, name).requires_grad_(source.requires_grad)
            if m.bias_k is not None:
                for mine, theirs in ((new.bias_k, m.bias_k), (new.bias_v, m.bias_v)):
                    mine.weight.copy_(theirs.reshape(1, e))
                    mine.weight.requires_grad_(theirs.requires_grad)
        return new.train(m.training)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = query.dim() == 3
        if not batched:  # unbatched (L, E): one example
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, B, E): batch first for the layers (a per-example rule needs it)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        b, tgt, _ = query.shape
        heads, hd = self.num_heads, self.head_dim
        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                               "method `generate_square_subsequent_mask` to create this mask.")
        causal = is_causal and key_padding_mask is None and not need_weights  # torch trusts the hint here too
        attn_mask = None if causal else F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                                          other_name="", target_type=query.dtype, check_other=False)
        q = self.q_proj(query).view(b, tgt, heads, hd).transpose(1, 2)  # (B, H, L, hd)
        k, v = self.k_proj(key), self.v_proj(value)  # (B, S, E)
        if self.bias_k is not None:
            ids = torch.zeros(b, 1, dtype=torch.long, device=k.device)
            k, v = torch.cat([k, self.bias_k(ids)], 1), torch.cat([v, self.bias_v(ids)], 1)
        k = k.view(b, -1, heads, hd).transpose(1, 2)
        v = v.view(b, -1, heads, hd).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(b, heads, 1, hd)], 2)
            v = torch.cat([v, v.new_zeros(b, heads, 1, hd)], 2)
        src = k.shape[2]
        mask = None
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                mask = attn_mask.view(1, 1, *attn_mask.shape)
            elif attn_mask.dim() == 3:  # (B * H, L, S), example-major as torch lays it out
                mask = attn_mask.reshape(b, heads, *attn_mask.shape[1:])
            else:
                raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
            mask = F.pad(mask, (0, src - mask.shape[-1]))  # the appended bias key, the zero key: never masked
        if key_padding_mask is not None:
            pad = F.pad(key_padding_mask, (0, src - key_padding_mask.shape[-1])).view(b, 1, 1, src)
            mask = pad if mask is None else mask + pad
        p = self.dropout if self.training else 0.0
        if need_weights:
            scores = torch.matmul(q * math.sqrt(1.0 / hd), k.transpose(-2, -1))
            if mask is not None:
                scores = scores + mask
            weights = torch.softmax(scores, dim=-1)
            if p > 0:
                weights = F.dropout(weights, p=p)
            out = torch.matmul(weights, v)
        else:
            weights = None
            if mask is not None and mask.dtype != q.dtype:
                mask = mask.to(q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.expand(
                b, heads, tgt, src), dropout_p=p, is_causal=causal)
        out = self.out_proj(out.transpose(1, 2).reshape(b, tgt, self.embed_dim))
        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights


def replace(model: nn.Module) -> list[str]:
    """Swap every trainable ``nn.MultiheadAttention`` of ``model`` (in place) for
    :class:`PerExampleMultiheadAttention` with its weights; returns what was swapped, one note each. Encoders stop converting inputs to nested tensors (their fast
    path, which would hand the swapped layer what it was not built for)."""
    notes = []
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.MultiheadAttention:  # a subclass may compute otherwise: Opacus' fix decides
                continue
            if not any(p.requires_grad for p in child.parameters()):  # frozen: no per-example gradient to take,
                continue  # and its state dict keeps the names its weights were saved under
            setattr(parent, child_name, PerExampleMultiheadAttention.from_torch(child))
            path = f"{name}.{child_name}" if name else child_name
            notes.append(f"{path}: MultiheadAttention -> PerExampleMultiheadAttention (weights carried)")
    if notes:
        for m in model.modules():
            if isinstance(m, nn.TransformerEncoder):
                m.use_nested_tensor = False
    return notes
