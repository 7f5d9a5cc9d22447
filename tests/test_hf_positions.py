"""Hugging Face BERT and GPT-2 train their position embeddings unfrozen: workbench.hf.model gives each example its own
position_ids (arange(T), the models' own default), so the position embedding is looked up per example and bk's
Embedding rule (or Opacus' hooks) clips it exactly, checked against the float64 per-example oracle. Needs the hf extra."""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from tests.oracle import CLIPPED_RTOL, clipped_sum  # noqa: E402
from tests.test_hf import BERT, GPT2  # noqa: E402
from workbench import hf  # noqa: E402
from workbench.distributed import setup  # noqa: E402
from workbench.errors import WorkbenchError  # noqa: E402
from workbench.losses import TokenCrossEntropy  # noqa: E402
from workbench.step import GradientStep  # noqa: E402


def _make(name):
    torch.manual_seed(0)
    if name == "bert":
        return hf.model(config=BERT, num_labels=2, freeze=[])
    return hf.model(config=GPT2, task="causal_lm", freeze=[])


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(3, 60, (6, 7))
    mask = torch.ones(6, 7, dtype=torch.long)
    mask[0, 5:], mask[2, 3:] = 0, 0  # padded on the right, as PadCollator pads
    return ids, mask


POSITIONS = {"bert": "bert.embeddings.position_embeddings.weight", "gpt2": "transformer.wpe.weight"}


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_per_example_position_ids_keep_the_models_outputs(name):
    model = _make(name).eval()
    ids, mask = _batch()
    hooked = model(input_ids=ids, attention_mask=mask).logits
    model._forward_pre_hooks.clear()
    torch.testing.assert_close(hooked, model(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_hf_position_embeddings_train_unfrozen_through_auto(name):
    ids, mask = _batch()
    if name == "bert":
        labels, criterion = torch.tensor([0, 1, 1, 0, 1, 0]), nn.CrossEntropyLoss(reduction="none")

        def loss(m, e):
            return nn.functional.cross_entropy(m(input_ids=e["input_ids"][None],
                                                 attention_mask=e["attention_mask"][None]).logits, e["labels"][None])
    else:
        labels, criterion = ids.masked_fill(mask == 0, -100), TokenCrossEntropy()

        def loss(m, e):
            return TokenCrossEntropy()(m(input_ids=e["input_ids"][None],
                                         attention_mask=e["attention_mask"][None]).logits, e["labels"][None])[0]
    examples = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(6)]
    expected = clipped_sum(_make(name), examples, 0.1, loss)
    assert expected.clipped >= 3
    step = GradientStep(_make(name), criterion, setup("gloo"), max_grad_norm=0.1, noise_multiplier=0.0,
                        grad_sample_mode="auto", max_physical_batch_size=4)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    step.check(batch)
    assert step.mode == "bk", step.mode_note  # GPT-2's Conv1D included (a Linear stored transposed)
    step(batch, step=0)
    named = [n for n, p in step.model.named_parameters() if p.requires_grad]
    assert POSITIONS[name] in named
    for n, p, e in zip(named, step.params, expected.grads):
        torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-7, msg=n)
    assert step.params[named.index(POSITIONS[name])].grad.abs().sum() > 0


def test_the_models_own_position_ids_of_shape_1_by_t_train_on_bk():
    """Without workbench's per-example position_ids, BERT looks its positions up with ids (1, T), broadcast over the
    batch: bk expands them to (B, T) (a leading 1 taken as the batch's) and clips the table exactly."""
    ids, mask = _batch()
    labels = torch.tensor([0, 1, 1, 0, 1, 0])

    def loss(m, e):
        return nn.functional.cross_entropy(m(input_ids=e["input_ids"][None],
                                             attention_mask=e["attention_mask"][None]).logits, e["labels"][None])
    examples = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(6)]
    model = _make("bert")
    model._forward_pre_hooks.clear()
    expected = clipped_sum(model, examples, 0.1, loss)
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=0.1,
                        noise_multiplier=0.0, grad_sample_mode="auto", max_physical_batch_size=4)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    step.check(batch)
    assert step.mode == "bk", step.mode_note
    step(batch, step=0)
    named = [n for n, p in step.model.named_parameters() if p.requires_grad]
    for n, p, e in zip(named, step.params, expected.grads):
        torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-7, msg=n)
    assert step.params[named.index(POSITIONS["bert"])].grad.abs().sum() > 0


def test_auto_refusing_shared_positions_suggests_no_fix_auto_already_tried():
    model = _make("bert")
    model.bert.embeddings.word_embeddings.scale_grad_by_freq = True  # bk refuses it; the rest fail the shared ids
    model._forward_pre_hooks.clear()  # the model's own shared position ids: no per-layer mode, and HF's forward fails vmap
    ids, mask = _batch()
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=0.1,
                        noise_multiplier=0.0, grad_sample_mode="auto")
    with pytest.raises(WorkbenchError) as e:
        step.check({"input_ids": ids, "attention_mask": mask, "labels": torch.zeros(6, dtype=torch.long)})
    msg = str(e.value)
    assert msg.startswith("grad_sample_mode=auto found no mode") and "\n" not in msg
    assert "position_embeddings (Embedding)" in msg and "torch.arange(T).expand(B, T)" in msg
    assert "use grad_sample_mode=auto" not in msg
