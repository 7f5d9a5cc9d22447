"""Small models that train in seconds on CPU, and a frozen backbone under a trainable head. Any ``torch.nn.Module``
plugs in by config (``model._target_``); workbench/models/fixing.py makes one fit for DP-SGD."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from workbench.errors import WorkbenchError


class MLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: Sequence[int] = (128,), num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """For 8x8 single-channel images (digits as 1x8x8). GroupNorm, not BatchNorm: DP-SGD needs per-example independence."""

    def __init__(self, num_classes: int = 10, channels: int = 16):
        super().__init__()
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, channels, 3, padding=1), nn.GroupNorm(4, channels), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1, stride=2), nn.GroupNorm(4, 2 * channels), nn.ReLU(),
            nn.Flatten(), nn.Linear(2 * channels * 16, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _conv_norm(c_in: int, c_out: int, kernel: int, stride: int, groups: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False),
                         nn.GroupNorm(min(groups, c_out), c_out))


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with a residual connection (a 1x1 projection where the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int):
        super().__init__()
        self.conv1, self.conv2 = _conv_norm(c_in, c_out, 3, stride, groups), _conv_norm(c_out, c_out, 3, 1, groups)
        self.shortcut = _conv_norm(c_in, c_out, 1, stride, groups) if stride != 1 or c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv2(torch.relu(self.conv1(x))) + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet for 3x32x32 images (CIFAR-10): a 3x3 stem, ``blocks`` BasicBlocks per stage (default one; each stage
    after the first halves the resolution at its first block), global average pooling, a linear head. ResNet-18 is
    widths (64, 128, 256, 512) with blocks 2. GroupNorm, not BatchNorm: BatchNorm mixes the examples of a batch, so an
    example's gradient would not be its own."""

    def __init__(self, num_classes: int = 10, widths: Sequence[int] = (16, 32, 64), groups: int = 4, in_channels: int = 3,
                 blocks: int = 1):
        super().__init__()
        stages, width = [_conv_norm(in_channels, widths[0], 3, 1, groups), nn.ReLU()], widths[0]
        for i, w in enumerate(widths):
            for b in range(blocks):
                stages.append(BasicBlock(width, w, 2 if i > 0 and b == 0 else 1, groups))
                width = w
        self.features = nn.Sequential(*stages)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class TransformerClassifier(nn.Module):
    """A small ``nn.TransformerEncoder`` over a (B, tokens * features) input read as a sequence (digits: 8 rows of 8
    pixels). ``privacy.fix_model`` swaps its nn.MultiheadAttention for workbench.models.attention.PerExampleMultiheadAttention."""

    def __init__(self, tokens: int = 8, features: int = 8, width: int = 32, heads: int = 2, layers: int = 1,
                 num_classes: int = 10):
        super().__init__()
        self.tokens = tokens
        self.embed = nn.Linear(features, width)
        self.position = nn.Parameter(torch.zeros(tokens, width))  # used once per example: per-sample exact
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(len(x), self.tokens, -1))
        return self.head(self.encoder(h + self.position).mean(1))


class LSTMClassifier(nn.Module):
    """An ``nn.LSTM`` over a (B, tokens * features) input read as a sequence; ``privacy.fix_model`` swaps in DPLSTM."""

    def __init__(self, tokens: int = 8, features: int = 8, hidden: int = 32, num_classes: int = 10):
        super().__init__()
        self.tokens = tokens
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.reshape(len(x), self.tokens, -1))
        return self.head(out[:, -1])


def frozen_backbone(model: nn.Module, trainable: Sequence[str] = ("head",), weights: str | None = None) -> nn.Module:
    """A trainable head on a frozen backbone: ``model`` (Hydra builds it from ``model.model``), its state dict first
    loaded from ``weights`` (e.g. a backbone pre-trained on public data), then every parameter whose name starts with
    none of ``trainable`` frozen. Frozen parameters get no gradient, no clipping and no noise (the noise has the
    trainable parameters' size); checkpoints still hold the whole model, so it rebuilds as it was trained.

        python -m workbench model._target_=workbench.models.frozen_backbone +model.model._target_=my_pkg.Net
    """
    if weights is not None:
        from pathlib import Path

        if not Path(weights).is_file():
            raise WorkbenchError(f"model.weights={weights!r} is not a file (a state dict saved with torch.save)")
        try:
            model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        except Exception as e:  # noqa: BLE001 - a wrong file or another model's keys: one line
            raise WorkbenchError(f"model.weights={weights!r} does not fit the model: {str(e).splitlines()[0]}") from e
    names = [name for name, _ in model.named_parameters()]
    for prefix in trainable:
        if not any(name.startswith(prefix) for name in names):
            raise WorkbenchError(f"model.trainable={prefix!r} matches no parameter (they are e.g. {names[:3]})")
    for name, p in model.named_parameters():
        p.requires_grad_(any(name.startswith(prefix) for prefix in trainable))
    return model


class TinyTransformer(nn.Module):
    """One pre-LN transformer block built only from nn.Embedding, nn.Linear and nn.LayerNorm (every layer has a
    book-keeping rule): token and position embeddings, causal self-attention, an MLP, mean-pooled classification.
    For digits, each image is a sequence of 64 pixel tokens (intensities 0..16)."""

    def __init__(self, vocab: int = 17, max_len: int = 64, d_model: int = 64, heads: int = 4, num_classes: int = 10):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(max_len, d_model)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.up, self.down = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)
        self.head, self.heads = nn.Linear(d_model, num_classes), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x if not x.is_floating_point() else (x * 16).round().long()  # digits' pixels in [0, 1] -> 0..16
        b, t = ids.shape
        # position ids per example (batch first, contiguous): per-sample gradients need each example's own rows
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device).expand(b, t).contiguous())
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        h = h + self.proj(att)
        h = h + self.down(torch.relu(self.up(self.ln2(h))))
        return self.head(self.ln_f(h).mean(1))


class GPT(nn.Module):
    """A small causal language model written the way tutorials write it: a token embedding plus a learned position
    embedding looked up with ``torch.arange(T)`` (ids shared by the whole batch), pre-LN ``nn.TransformerEncoderLayer``
    blocks under a causal mask (``is_causal=True``), a final LayerNorm and a linear LM head. Ids (B, T) -> logits
    (B, T, vocab), for ``workbench.losses.TokenCrossEntropy(shift=True)``. ``privacy.fix_model`` swaps each block's
    nn.MultiheadAttention for workbench.models.attention.PerExampleMultiheadAttention (same function)."""

    def __init__(self, vocab: int = 32, max_len: int = 32, d_model: int = 64, heads: int = 4, layers: int = 2,
                 dropout: float = 0.0):
        super().__init__()
        self.max_len = max_len
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(max_len, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.max_len:
            raise WorkbenchError(f"GPT got sequences of {t} tokens; model.max_len is {self.max_len}")
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))  # (B, T, d) + (T, d)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        return self.head(self.ln_f(self.blocks(h, mask=mask, is_causal=True)))


class ViT(nn.Module):
    """A small vision transformer written the way tutorials write it: non-overlapping patches by a strided
    ``nn.Conv2d``, a cls token and a position table as raw ``nn.Parameter`` s (broadcast over the batch), pre-LN
    ``nn.TransformerEncoder`` blocks, a LayerNorm and a linear head on the cls token. Takes (B, C, H, W) images or the
    same flattened (digits: 64 features read as 1x8x8)."""

    def __init__(self, image_size: int = 8, patch: int = 2, channels: int = 1, d_model: int = 32, heads: int = 4,
                 layers: int = 2, num_classes: int = 10, dropout: float = 0.0):
        super().__init__()
        if image_size % patch:
            raise WorkbenchError(f"ViT: model.image_size={image_size} is not a multiple of model.patch={patch}")
        self.shape = (channels, image_size, image_size)
        self.patch = nn.Conv2d(channels, d_model, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.randn(1, (image_size // patch) ** 2 + 1, d_model) * 0.02)
        block = nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch(x.reshape(len(x), *self.shape)).flatten(2).transpose(1, 2)  # (B, patches, d)
        h = torch.cat([self.cls.expand(len(x), -1, -1), p], 1) + self.pos
        return self.head(self.norm(self.encoder(h))[:, 0])
