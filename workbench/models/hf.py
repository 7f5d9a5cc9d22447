"""Hugging Face models and LoRA adapters, with no network: every model comes from a local path or is made from an
inline config. Needs the ``hf`` extra (transformers, peft), imported only when one of these functions is called: a job
that uses none of them never imports transformers. What a checkpoint keeps of a model (the adapter alone for a PEFT
model) is here too. The text data is in workbench/data/text.py; ``workbench.hf`` is the public path of both.

    python -m workbench model=hf data=hf_text data.source=train.jsonl data.tokenizer=./tok model.path=./bert
    python -m workbench experiment=lm_lora          # tiny GPT-2 + LoRA on synthetic text, with DP
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from workbench.data.text import TASKS, load_transformers
from workbench.errors import WorkbenchError


def model(task: str = "classification", path: str | None = None, config: dict | None = None,
          num_labels: int | None = None, freeze: Sequence[str] = ()) -> nn.Module:
    """``AutoModelForSequenceClassification`` (task=classification) or ``AutoModelForCausalLM`` (task=causal_lm), from
    a local folder (``path``, ``local_files_only``) or, randomly initialised, from an inline ``config`` (``model_type``
    plus the config's fields). Parameters whose name starts with one of ``freeze`` are not trained (nor clipped)."""
    t = load_transformers()
    if task not in TASKS:
        raise WorkbenchError(f"model.task={task!r} is unknown; choose one of {', '.join(TASKS)}")
    if (path is None) == (config is None):
        raise WorkbenchError("model=hf needs exactly one of model.path (a local folder) or model.config (inline)")
    auto = t.AutoModelForSequenceClassification if task == "classification" else t.AutoModelForCausalLM
    extra = {"num_labels": num_labels} if task == "classification" and num_labels is not None else {}
    if path is not None:
        if not Path(path).is_dir():
            raise WorkbenchError(f"model.path={path!r} is not a local folder (nothing is downloaded)")
        # float32 weights whatever the folder holds (transformers loads a bf16 checkpoint as bf16): DP-SGD's sum and
        # noise are float32; bf16=true is the way to compute in bf16
        built = auto.from_pretrained(path, local_files_only=True, dtype=torch.float32, **extra)
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
    if built.config.model_type in ARANGE_POSITIONS and \
            getattr(built.config, "position_embedding_type", "absolute") == "absolute":
        built.register_forward_pre_hook(per_example_position_ids, with_kwargs=True)
    return built


# Model types whose default position ids are torch.arange(T) for every example (no cache): the same ids given per
# example compute the same function, and their position embeddings then have per-example gradients (bk's Embedding
# rule sees a batch dimension). Not e.g. RoBERTa or OPT, whose positions depend on padding.
ARANGE_POSITIONS = ("bert", "gpt2")


def per_example_position_ids(module: nn.Module, args: tuple, kwargs: dict):
    """A forward pre-hook: ``position_ids`` (B, T) = arange(T) for each example, where the caller gave none and no
    cache is in use (as dp-transformers does). The model's own default is arange(T) shared by the batch, whose
    embedding gradient only a whole-model mode could split per example, and HF's forward cannot run under vmap."""
    if kwargs.get("position_ids") is not None or kwargs.get("past_key_values") is not None:
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not torch.is_tensor(ids) or ids.dim() != 2:
        return None  # inputs_embeds, or unbatched ids: the model's own default
    b, t = ids.shape
    return args, {**kwargs, "position_ids": torch.arange(t, device=ids.device).expand(b, t).contiguous()}


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
