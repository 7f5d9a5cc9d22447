"""The public path of the Hugging Face parts (``workbench.hf.model``, ``workbench.hf.lora``,
``workbench.hf.TextDataset``, ``workbench.hf.synthetic_text``, ``workbench.hf.synthetic_tokenizer``: what configs
name), kept as re-exports: the models and LoRA live in workbench/models/hf.py, the text data in workbench/data/text.py.
Importing it imports neither transformers nor peft. New code imports the modules themselves."""

from workbench.data.text import (TASKS, TextDataset, load_tokenizer, load_transformers, synthetic_text,
                                 synthetic_tokenizer, synthetic_words, word_tokenizer)
from workbench.models.hf import is_adapter, load_model_state, lora, model, model_state

__all__ = ["TASKS", "TextDataset", "is_adapter", "load_model_state", "load_tokenizer", "load_transformers", "lora",
           "model", "model_state", "synthetic_text", "synthetic_tokenizer", "synthetic_words", "word_tokenizer"]
