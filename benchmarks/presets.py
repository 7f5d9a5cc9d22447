"""The presets the benchmarks measure, built exactly as ``python -m workbench`` builds them: the config composed by
``workbench.compose`` (Hydra, ``conf/``), then data, model (+ LoRA adapters, + ``prepare_model``) and criterion
instantiated from it the way ``workbench.job.build`` does, under the preset's seed. Batches are drawn by workbench's
Poisson sampler and collated by workbench's training loader (the preset's ``data.collator``), then replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn

# name -> (Hydra overrides, what it is). The order is the order of the tables.
PRESETS: dict[str, tuple[list[str], str]] = {
    "mlp": ([], "default MLP 64-128-10 (conf/model/mlp.yaml) on digits"),
    "images_resnet": (["experiment=images_resnet"],
                      "ResNet with GroupNorm, widths 8-16-32 (conf/experiment/images_resnet.yaml) on CIFAR-shaped "
                      "synthetic images 3x32x32"),
    "text_classifier": (["experiment=text_classifier"],
                        "tiny BERT via Hugging Face, embeddings frozen (conf/experiment/text_classifier.yaml) on "
                        "synthetic text, mapping batches"),
    "lm_lora": (["experiment=lm_lora"],
                "tiny GPT-2 + LoRA r=8 on c_attn, c_proj (conf/experiment/lm_lora.yaml), token-level loss on "
                "synthetic Markov text"),
    "transformer": (["model=transformer"],
                    "TinyTransformer (conf/model/transformer.yaml): digits' 64 pixels as tokens"),
    "gpt": (["experiment=gpt"],
            "GPT as tutorials write it: learned positions by torch.arange(T), 2 nn.TransformerEncoderLayer blocks under a "
            "causal mask (conf/experiment/gpt.yaml), token-level loss on synthetic Markov token walks"),
    "vit": (["experiment=vit"],
            "ViT as tutorials write it: patch conv, cls token and position table as raw nn.Parameters, one "
            "nn.TransformerEncoder block (conf/experiment/vit.yaml) on digits"),
    "cnn": (["model=cnn"], "SmallCNN (conf/model/cnn.yaml) on digits"),  # vs_opacus and distributed_scaling only
    # issue 24's real-size presets (benchmarks/real_size.py)
    "bench_minilm": (["experiment=bench_minilm"],
                     "MiniLM-sized BERT encoder: 6 layers, hidden 384, 30,522-token vocabulary, embeddings frozen "
                     "(conf/experiment/bench_minilm.yaml), classifying synthetic 256-token sequences"),
    "bench_gpt2_lora": (["experiment=bench_gpt2_lora"],
                        "GPT-2-shaped decoder: 6 layers, hidden 384, 50,257-token vocabulary, LoRA r=8 on attention "
                        "and MLP (conf/experiment/bench_gpt2_lora.yaml), next-token loss on synthetic 256-token sequences"),
    "bench_resnet18": (["experiment=bench_resnet18"],
                       "ResNet-18 with GroupNorm (conf/experiment/bench_resnet18.yaml) on CIFAR-shaped synthetic "
                       "images 3x32x32"),
}


@dataclass
class Preset:
    """One composed preset: fresh models on demand (identical initial weights), its criterion, data and batch."""

    name: str
    cfg: Any

    @property
    def batch_size(self) -> int:
        return int(self.cfg.per_device_train_batch_size)

    @property
    def what(self) -> str:
        return PRESETS[self.name][1]

    def model(self) -> nn.Module:
        """The model as ``workbench.job.build`` makes it: ``model`` node, then ``peft``, then ``prepare_model``."""
        from workbench import overrides
        from workbench.models import prepare_model

        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        model = instantiate(overrides.own_arguments(cfg, "model"))
        if cfg.get("peft") is not None:
            model = instantiate(cfg.peft, _partial_=True)(model)
        model, _ = prepare_model(model, cfg.privacy.enabled, cfg.privacy.fix_model)
        return model.train()

    def criterion(self, **kwargs) -> nn.Module:
        return instantiate(self.cfg.criterion, **kwargs)

    @cached_property
    def dataset(self):
        from workbench import overrides
        return instantiate(overrides.own_arguments(self.cfg, "data.train"))

    @cached_property
    def collator(self):
        from workbench import overrides
        node = self.cfg.data.get("collator")
        return None if node is None else instantiate(overrides.own_arguments(self.cfg, "data.collator"))

    def poisson_batches(self, count: int, seed: int = 0, rank: int = 0, world_size: int = 1) -> list:
        """``count`` collated batches of this rank's ``per_rank`` shard, as the training loader yields them."""
        from workbench import data
        from workbench.privacy import sampling

        shard = sampling.train_shard(len(self.dataset), rank, world_size, "per_rank", self.batch_size)
        sampler = sampling.PoissonBatchSampler(shard, count, seed, rank)
        return list(data.train_loader(self.dataset, sampler, self.cfg, torch.device("cpu"), self.collator))

    def first_examples(self, count: int):
        """The dataset's first ``count`` examples, collated as in training (the pre-run check's and memory's batch)."""
        from workbench import data

        return data.first_examples(self.dataset, count, self.collator)


_COMPOSED: dict[tuple, Any] = {}


def preset(name: str, max_batch: int | None = None, extra: tuple[str, ...] = ()) -> Preset:
    """The composed preset ``name`` (composed once per process); ``max_batch`` caps its per-device batch (quick mode:
    the same model and data at a smaller batch); ``extra``: more overrides (real_size's quick mode: shorter sequences)."""
    key = (name, max_batch, extra)
    if key not in _COMPOSED:
        from workbench import compose

        cfg = compose([*PRESETS[name][0], *extra])
        if max_batch is not None and cfg.per_device_train_batch_size > max_batch:
            cfg = compose([*PRESETS[name][0], *extra, f"per_device_train_batch_size={max_batch}"])
        _COMPOSED[key] = cfg
    return Preset(name, _COMPOSED[key])
