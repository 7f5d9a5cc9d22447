"""Hugging Face models, text data and LoRA adapters, with no network: every model, tokenizer and dataset comes from a
local path or is made from an inline config. Needs the ``hf`` extra (transformers, tokenizers, peft), imported only
when one of these functions is called: a job that uses none of them never imports transformers.

    python -m workbench model=hf data=hf_text data.source=train.jsonl data.tokenizer=./tok model.path=./bert
    python -m workbench experiment=lm_lora          # tiny GPT-2 + LoRA on synthetic text, with DP
"""

from __future__ import annotations

import csv
import json
import random
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from workbench.errors import WorkbenchError

TASKS = ("classification", "causal_lm")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise WorkbenchError("Hugging Face models need the hf extra: pip install -e '.[hf]'") from None
    transformers.logging.set_verbosity_error()  # tiny configs trip warnings about default token ids
    return transformers


def model(task: str = "classification", path: str | None = None, config: dict | None = None,
          num_labels: int | None = None, freeze: Sequence[str] = ()) -> nn.Module:
    """``AutoModelForSequenceClassification`` (task=classification) or ``AutoModelForCausalLM`` (task=causal_lm), from
    a local folder (``path``, ``local_files_only``) or, randomly initialised, from an inline ``config`` (``model_type``
    plus the config's fields). Parameters whose name starts with one of ``freeze`` are not trained (nor clipped)."""
    t = _transformers()
    if task not in TASKS:
        raise WorkbenchError(f"model.task={task!r} is unknown; choose one of {', '.join(TASKS)}")
    if (path is None) == (config is None):
        raise WorkbenchError("model=hf needs exactly one of model.path (a local folder) or model.config (inline)")
    auto = t.AutoModelForSequenceClassification if task == "classification" else t.AutoModelForCausalLM
    extra = {"num_labels": num_labels} if task == "classification" and num_labels is not None else {}
    if path is not None:
        if not Path(path).is_dir():
            raise WorkbenchError(f"model.path={path!r} is not a local folder (nothing is downloaded)")
        built = auto.from_pretrained(path, local_files_only=True, **extra)
    else:
        fields = dict(config)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise WorkbenchError("model.config needs a model_type (e.g. bert, gpt2)")
        built = auto.from_config(t.AutoConfig.for_model(model_type, **fields, **extra))
    names = [n for n, _ in built.named_parameters()]
    for prefix in freeze:
        if not any(n.startswith(prefix) for n in names):
            raise WorkbenchError(f"model.freeze={prefix!r} matches no parameter (they start with e.g. {names[0]!r})")
    for n, p in built.named_parameters():
        if any(n.startswith(prefix) for prefix in freeze):
            p.requires_grad_(False)
    return built


def lora(model: nn.Module, r: int = 8, alpha: float = 16, target_modules: Sequence[str] | None = None,
         dropout: float = 0.0, modules_to_save: Sequence[str] | None = None) -> nn.Module:
    """Wrap ``model`` with LoRA adapters (peft): only the adapters (and ``modules_to_save``, e.g. a classifier head)
    train, so only they are clipped and noised."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise WorkbenchError("peft=lora needs the hf extra: pip install -e '.[hf]'") from None
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules) if target_modules else None,
                        lora_dropout=dropout, modules_to_save=list(modules_to_save) if modules_to_save else None)
    try:
        with warnings.catch_warnings():  # GPT-2's Conv1D: peft sets fan_in_fan_out itself, and says so
            warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
            return get_peft_model(model, config)
    except ValueError as e:
        raise WorkbenchError(f"peft=lora: {str(e).splitlines()[0]}") from None


def is_adapter(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of the model: the adapter alone for a PEFT model (the base is rebuilt from the logged
    config: a local path, or an inline config under the run's seed), else the whole state dict."""
    if is_adapter(model):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model)
    return model.state_dict()


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    if is_adapter(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, state)
        if getattr(result, "unexpected_keys", None):
            raise WorkbenchError(f"the checkpoint's adapter does not fit this model: {result.unexpected_keys[:3]}")
        return
    model.load_state_dict(state)


def load_tokenizer(path: str):
    """A tokenizer from a local folder (``save_pretrained`` output); nothing is downloaded."""
    t = _transformers()
    if not Path(path).is_dir():
        raise WorkbenchError(f"data.tokenizer={path!r} is not a local folder (nothing is downloaded)")
    return t.AutoTokenizer.from_pretrained(path, local_files_only=True)


def word_tokenizer(words: Sequence[str]):
    """A whitespace word-level tokenizer over a fixed vocabulary: [PAD]=0, [UNK]=1, [CLS]=2 (put first in every
    sequence: BERT's classifier reads it), then ``words``."""
    t = _transformers()
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
