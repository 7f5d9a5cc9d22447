"""The models a job trains, and what DP-SGD needs of them:

- zoo.py        small models that train in seconds on CPU (MLP, SmallCNN, ResNet, TransformerClassifier,
                LSTMClassifier, TinyTransformer, GPT, ViT) and frozen_backbone (a trainable head on a frozen backbone)
- fixing.py     prepare_model (``privacy.fix_model``): layers no clipping route covers swapped for DP equivalents, or
                the model refused in one line
- hf.py         Hugging Face models and LoRA adapters (the hf extra, imported only when called); what a checkpoint
                keeps of a model (model_state, load_model_state)
- losses.py     model outputs (``.logits``) and per-example losses, token-level for language models

The names below are re-exported: ``workbench.models.MLP`` ... are the paths configs use (``model._target_``). The
Hugging Face functions and the losses keep their public paths ``workbench.hf`` and ``workbench.losses``; importing
this package imports neither transformers nor peft.
"""

from workbench.models.fixing import per_example_norm, prepare_model
from workbench.models.zoo import (GPT, MLP, BasicBlock, LSTMClassifier, ResNet, SmallCNN, TinyTransformer,
                                  TransformerClassifier, ViT, frozen_backbone)

__all__ = ["BasicBlock", "GPT", "LSTMClassifier", "MLP", "ResNet", "SmallCNN", "TinyTransformer",
           "TransformerClassifier", "ViT", "frozen_backbone", "per_example_norm", "prepare_model"]
