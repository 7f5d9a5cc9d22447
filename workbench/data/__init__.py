"""The data a job trains and evaluates on, and nothing about the model or the mechanism:

- datasets.py   the datasets: ArrayDataset, Digits (a fixed stratified split), Synthetic, SyntheticImages,
                SyntheticTokens (Markov token walks), SyntheticSequences (uniform ids at any vocabulary), CIFAR10 (read
                by an unpickler that accepts arrays and lists only), TokenMemmap (token ids in a memory-mapped file:
                only the drawn rows are read)
- text.py       Hugging Face text: local text tokenized once (TextDataset), synthetic text tasks and their tokenizer
- batches.py    what a batch is: collation (an empty Poisson draw is None), PadCollator, the trainer's Batch
- loaders.py    the training loader over the mechanism's Poisson batches (drawn in workbench/privacy/sampling.py), the
                eval shards and loader, the examples the pre-run checks read
- checks.py     the pre-run check that each dataset fits the model and the criterion; the example a failed step blames

The names below are re-exported: ``workbench.data.Digits``, ``workbench.data.PadCollator`` ... are the paths configs
use (``data.train._target_``, ``data.collator._target_``).
"""

from workbench.data.batches import Batch, PadCollator, as_batch, collate
from workbench.data.checks import blame_example, check_fit
from workbench.data.datasets import (CIFAR10, ArrayDataset, Digits, Synthetic, SyntheticImages, SyntheticSequences,
                                     SyntheticTokens, TokenMemmap)
from workbench.data.loaders import check_dataset, eval_loader, eval_shard, examples, first_examples, train_loader
from workbench.data.text import TextDataset, synthetic_text, synthetic_tokenizer

__all__ = ["ArrayDataset", "Batch", "CIFAR10", "Digits", "PadCollator", "Synthetic", "SyntheticImages", "SyntheticSequences",
           "SyntheticTokens", "TextDataset", "TokenMemmap", "as_batch", "blame_example", "check_dataset", "check_fit", "collate", "eval_loader", "eval_shard",
           "examples", "first_examples", "synthetic_text", "synthetic_tokenizer", "train_loader"]
