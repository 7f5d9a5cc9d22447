"""Hugging Face text data, with no network: local text (``.jsonl``, ``.csv`` or a ``datasets.save_to_disk`` folder)
tokenized once by a local tokenizer, and synthetic text tasks with their word tokenizer, made on the fly. Needs the
``hf`` extra (transformers, tokenizers), imported only when one of these functions is called. The models that read
this data (and LoRA) are in workbench/models/hf.py; ``workbench.hf`` is the public path of both.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.utils.data import Dataset

from workbench.errors import WorkbenchError

TASKS = ("classification", "causal_lm")


def load_transformers():
    """transformers, quiet; or a one-line refusal naming the hf extra. Imported here only when called."""
    try:
        import transformers
    except ImportError:
        raise WorkbenchError("Hugging Face models need the hf extra: pip install -e '.[hf]'") from None
    transformers.logging.set_verbosity_error()  # tiny configs trip warnings about default token ids
    return transformers


def load_tokenizer(path: str):
    """A tokenizer from a local folder (``save_pretrained`` output); nothing is downloaded."""
    t = load_transformers()
    if not Path(path).is_dir():
        raise WorkbenchError(f"data.tokenizer={path!r} is not a local folder (nothing is downloaded)")
    return t.AutoTokenizer.from_pretrained(path, local_files_only=True)


def word_tokenizer(words: Sequence[str]):
    """A whitespace word-level tokenizer over a fixed vocabulary: [PAD]=0, [UNK]=1, [CLS]=2 (put first in every
    sequence: BERT's classifier reads it), then ``words``."""
    t = load_transformers()
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 2)])
    return t.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]")


# Synthetic text: learnable tasks made on the fly (seconds on CPU), for presets and tests.
_GOOD = ["good", "great", "fine", "lovely", "superb", "happy", "bright", "calm"]
_BAD = ["bad", "awful", "poor", "grim", "sad", "dull", "harsh", "bleak"]
_FILL = ["the", "a", "day", "film", "meal", "room", "was", "is", "very", "quite", "and", "but", "so", "it"]
# A first-order Markov chain for language modelling: each word has two or three likely successors.
_CHAIN = {"the": ["cat", "dog", "bird"], "cat": ["sat", "ran"], "dog": ["ran", "barked"], "bird": ["sang", "flew"],
          "sat": ["on", "down"], "ran": ["to", "away"], "barked": ["at", "loudly"], "sang": ["to", "softly"],
          "flew": ["to", "away"], "on": ["the"], "down": ["."], "to": ["the"], "away": ["."], "at": ["the"],
          "loudly": ["."], "softly": ["."], ".": ["the"]}


def synthetic_words() -> list[str]:
    return sorted(set(_GOOD + _BAD + _FILL) | set(_CHAIN) | {w for ws in _CHAIN.values() for w in ws})


def synthetic_tokenizer():
    """The word tokenizer over every word the synthetic tasks use."""
    return word_tokenizer(synthetic_words())


def synthetic_text(task: str = "classification", size: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """Records ``{"text", "label"}``. classification: 6-14 words; label 1 when the sentence has more "good" words than
    "bad" ones (ties are not drawn). causal_lm: walks of 8-16 words on a small Markov chain (perplexity floor ~2)."""
    rng = random.Random(seed)
    records = []
    while len(records) < size:
        if task == "classification":
            words = [rng.choice(_FILL + _GOOD + _BAD) for _ in range(rng.randint(6, 14))]
            good, bad = sum(w in _GOOD for w in words), sum(w in _BAD for w in words)
            if good != bad:
                records.append({"text": " ".join(words), "label": int(good > bad)})
        elif task == "causal_lm":
            words = ["the"]
            for _ in range(rng.randint(7, 15)):
                words.append(rng.choice(_CHAIN[words[-1]]))
            records.append({"text": " ".join(words)})
        else:
            raise WorkbenchError(f"synthetic_text task={task!r} is unknown; choose one of {', '.join(TASKS)}")
    return records


def _records(source: Any, split: str | None) -> list[dict[str, Any]]:
    if isinstance(source, (list, tuple)):
        return [dict(r) for r in source]
    path = Path(str(source))
    if path.is_dir():  # a datasets.save_to_disk folder
        try:
            import datasets
        except ImportError:
            raise WorkbenchError(f"data.source={str(path)!r} is a folder: reading it needs `datasets` "
                                 "(pip install datasets), or give a .jsonl / .csv file") from None
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise WorkbenchError(f"data.source={str(path)!r} has splits {sorted(ds)}; set split to one of them")
            ds = ds[split]
        return [dict(r) for r in ds]
    if not path.is_file():
        raise WorkbenchError(f"data.source={str(path)!r} does not exist (a local .jsonl, .csv or load_from_disk folder)")
    if path.suffix == ".jsonl":
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    raise WorkbenchError(f"data.source={str(path)!r}: use a .jsonl or .csv file, or a datasets.save_to_disk folder")


class TextDataset(Dataset):
    """Local text, tokenized once: each example a mapping (``input_ids``, ``attention_mask``, ``labels``) for
    ``model(**batch)``; pad batches with :class:`workbench.data.PadCollator` (``data.collator``).

    task=classification: ``labels`` is the record's ``label_field`` (an int). task=causal_lm: ``labels`` are the input
    ids (the model's loss shifts them: :class:`workbench.losses.TokenCrossEntropy`).
    """

    def __init__(self, source: Any, tokenizer: Any, task: str = "classification", text_field: str = "text",
                 label_field: str = "label", max_length: int = 128, split: str | None = None):
        if task not in TASKS:
            raise WorkbenchError(f"data task={task!r} is unknown; choose one of {', '.join(TASKS)}")
        tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
        records = _records(source, split)
        missing = [f for f in (text_field, label_field if task == "classification" else None) if f and records
                   and f not in records[0]]
        if missing:
            raise WorkbenchError(f"the text records have no field {missing[0]!r} (they have {sorted(records[0])})")
        encoded = tok([r[text_field] for r in records], truncation=True, max_length=max_length)
        self.examples = []
        for i, r in enumerate(records):
            ids = torch.tensor(encoded["input_ids"][i])
            example = {"input_ids": ids, "attention_mask": torch.tensor(encoded["attention_mask"][i])}
            example["labels"] = torch.tensor(int(r[label_field])) if task == "classification" else ids.clone()
            self.examples.append(example)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.examples[i]
