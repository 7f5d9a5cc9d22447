"""Hugging Face models, local text data and LoRA, built on the fly (tokenizer, model folder, data files): nothing is
downloaded. Needs the hf extra."""

import json

import pytest
import torch
from mlflow import MlflowClient
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.oracle import clipped_sum  # noqa: E402
from workbench import hf  # noqa: E402
from workbench.data import PadCollator  # noqa: E402
from workbench.distributed import setup  # noqa: E402
from workbench.losses import TokenCrossEntropy  # noqa: E402
from workbench.step import GradientStep  # noqa: E402

GPT2 = dict(model_type="gpt2", vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0)


def test_local_files_tokenizer_and_model_folder_train_with_dp(tmp_path, make_cfg, mlflow_uri):
    tok_dir, model_dir = tmp_path / "tok", tmp_path / "bert"
    hf.synthetic_tokenizer().save_pretrained(tok_dir)
    torch.manual_seed(0)
    hf.model(config=dict(model_type="bert", vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64), num_labels=2).save_pretrained(model_dir)
    train_file, eval_file = tmp_path / "train.jsonl", tmp_path / "eval.csv"
    train_file.write_text("\n".join(json.dumps(r) for r in hf.synthetic_text(size=400, seed=0)))
    eval_file.write_text("text,label\n" + "\n".join(f"{r['text']},{r['label']}" for r in hf.synthetic_text(size=100, seed=1)))
    from workbench import train

    result = train(make_cfg("model=hf", f"model.path={model_dir}", "model.freeze=[bert.embeddings]", "data=hf_text",
                            f"data.tokenizer={tok_dir}", f"data.train.source={train_file}",
                            f"data.eval.source={eval_file}", "max_steps=5", "per_device_train_batch_size=32"))
    assert result.epsilon <= 8 and 0 <= result.metrics["eval_accuracy"] <= 1 and result.steps == 5
    frozen = [n for n, p in result.model.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith("bert.embeddings") for n in frozen)


def test_a_bf16_checkpoint_loads_as_float32_weights(tmp_path):
    """transformers loads a folder in the dtype it was saved in; DP-SGD's weights are float32 (bf16=true computes in
    bf16), so a bf16 checkpoint trains instead of being refused by the step."""
    hf.model(config=GPT2, task="causal_lm").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    loaded = hf.model(path=str(tmp_path / "bf16"), task="causal_lm")
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}


def test_bad_hf_input_is_refused_in_one_line(tmp_path):
    from workbench.errors import WorkbenchError

    with pytest.raises(WorkbenchError, match="is not a local folder"):
        hf.model(path=str(tmp_path / "nothing"))
    with pytest.raises(WorkbenchError, match="exactly one of model.path"):
        hf.model()
    with pytest.raises(WorkbenchError, match="matches no parameter"):
        hf.model(config=GPT2, task="causal_lm", freeze=["bert."])
    with pytest.raises(WorkbenchError, match="does not exist"):
        hf.TextDataset(str(tmp_path / "missing.jsonl"), hf.synthetic_tokenizer())


def _lora_lm():
    torch.manual_seed(0)
    model = hf.lora(hf.model(task="causal_lm", config=GPT2), r=4, alpha=8, target_modules=["c_attn"])
    for n, p in model.named_parameters():  # LoRA's B starts at zero: give it values so that every gradient flows
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    return model


@pytest.mark.parametrize("mode", ["auto", "hooks"])
def test_lora_clips_only_the_adapters_exactly(mode):
    ds = hf.TextDataset(hf.synthetic_text("causal_lm", size=6), hf.synthetic_tokenizer(), task="causal_lm")
    examples = [ds[i] for i in range(len(ds))]
    loss = TokenCrossEntropy()
    model = _lora_lm()
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    expected = clipped_sum(model, examples, 0.1,
                           lambda m, e: loss(m(input_ids=e["input_ids"][None]).logits, e["labels"][None])[0]).grads
    step = GradientStep(_lora_lm(), loss, setup("gloo"), max_grad_norm=0.1, noise_multiplier=0.0,
                        grad_sample_mode=mode, max_physical_batch_size=4)
    if mode == "auto":
        assert step.mode == "bk"  # LoRA's A and B are plain nn.Linear: book-keeping clips them
    raw = PadCollator()(examples)
    step.check(raw)
    step(raw, step=0)
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-4, atol=1e-6)


BERT = dict(model_type="bert", vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _bert():
    torch.manual_seed(0)
    return hf.model(config=BERT, num_labels=2, freeze=["bert.embeddings"])  # position ids are shared: frozen


@pytest.mark.parametrize("mode", ["auto", "hooks"])
def test_bert_classifier_clips_each_example_exactly(mode):
    """A padded batch of a BERT classifier: each example's clipped gradient is its own, as computed alone, unpadded."""
    ds = hf.TextDataset(hf.synthetic_text(size=6), hf.synthetic_tokenizer())
    examples = [ds[i] for i in range(len(ds))]
    assert len({len(e["input_ids"]) for e in examples}) > 1  # padding is exercised
    ce = nn.functional.cross_entropy
    expected = clipped_sum(_bert(), examples, 0.1, lambda m, e: ce(
        m(input_ids=e["input_ids"][None], attention_mask=e["attention_mask"][None]).logits, e["labels"][None])).grads
    step = GradientStep(_bert(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=0.1,
                        noise_multiplier=0.0, grad_sample_mode=mode, max_physical_batch_size=4)
    raw = PadCollator()(examples)
    step.check(raw)
    step(raw, step=0)
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-4, atol=1e-6)


def test_bert_masked_lm_trains_on_bk_with_its_head_tied_and_its_bias_shared():
    """BERT's masked-LM head: the decoder's weight is the word embeddings' and its bias also hangs on the head module
    (``self.decoder.bias = self.bias``): one Linear's bias, clipped by the tied pair's rule, against the per-example
    loop."""
    transformers = hf.load_transformers()
    cfg = transformers.BertConfig(**{k: v for k, v in BERT.items() if k != "model_type"})

    def make():
        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(cfg)
        model.bert.embeddings.position_embeddings.weight.requires_grad_(False)  # position ids are shared
        return model

    model = make()
    head = model.cls.predictions
    assert head.decoder.bias is head.bias and head.decoder.weight is model.bert.embeddings.word_embeddings.weight
    g = torch.Generator().manual_seed(1)
    examples = []
    for t in (5, 7, 9, 6):
        ids = torch.randint(0, 64, (t,), generator=g)
        labels = torch.full((t,), -100)
        labels[:2] = ids[:2]
        examples.append({"input_ids": ids, "attention_mask": torch.ones(t, dtype=torch.long), "labels": labels})
    loss = TokenCrossEntropy(shift=False)
    expected = clipped_sum(make(), examples, 0.1, lambda m, e: loss(
        m(input_ids=e["input_ids"][None]).logits, e["labels"][None])[0]).grads
    step = GradientStep(make(), loss, setup("gloo"), max_grad_norm=0.1, noise_multiplier=0.0, grad_sample_mode="auto",
                        max_physical_batch_size=4)
    raw = PadCollator()(examples)
    step.check(raw)
    assert step.mode == "bk", step.mode_note
    step(raw, step=0)
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-4, atol=1e-6)


def test_lm_lora_preset_logs_perplexity_and_keeps_the_adapter(make_cfg, mlflow_uri, tmp_path):
    from workbench import train

    cfg = make_cfg("experiment=lm_lora", "privacy.secure_seed=3")  # pinned: one deterministic run
    result = train(cfg)
    assert result.epsilon <= 8.0 and result.metrics["eval_perplexity"] < 4.0  # ~60 (uniform) untrained
    client = MlflowClient(tracking_uri=mlflow_uri)
    run = client.get_run(result.run_id)
    assert run.data.metrics["eval_perplexity"] == pytest.approx(result.metrics["eval_perplexity"])
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= \
        {a.path for a in client.list_artifacts(result.run_id, "adapter")}
    state = torch.load(result.checkpoint, weights_only=True)["model"]
    assert state and all("lora_" in k for k in state)  # the adapter, not the base
    # The base rebuilds from the logged config (inline, under the run's seed): resuming from the adapter continues.
    resumed = train(make_cfg("experiment=lm_lora", "privacy.secure_seed=3", f"resume_from_checkpoint={result.checkpoint}"))
    assert resumed.steps == result.steps
    for (n, a), (_, b) in zip(result.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), n

    # The run's MLflow model (mlflow.pytorch: the whole PEFT model, base and adapter, README says why) predicts what
    # the checkpoint does: the resumed job's model is the base rebuilt from the config with the checkpoint's adapter.
    import mlflow.pytorch

    (output,) = client.get_run(result.run_id).outputs.model_outputs[:1]
    logged = client.get_logged_model(output.model_id)
    assert float(logged.tags["workbench.epsilon"]) == pytest.approx(result.epsilon) and logged.tags["workbench.steps"] == "60"
    published = mlflow.pytorch.load_model(f"models:/{output.model_id}").eval()
    assert hf.is_adapter(published) and type(published) is type(resumed.model)
    tokens = torch.randint(0, 59, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(published(input_ids=tokens).logits, resumed.model.eval()(input_ids=tokens).logits)


def test_text_classifier_preset_reaches_its_accuracy(make_cfg):
    from workbench import train

    result = train(make_cfg("experiment=text_classifier", "privacy.secure_seed=3"))
    assert result.epsilon <= 8.0 and result.metrics["eval_accuracy"] >= 0.75  # 0.5 by chance


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["per_rank", "global"])
def test_lm_lora_preset_at_two_ranks(make_cfg, shard):
    from workbench import launch_distributed, train

    def job(cfg):
        result = train(cfg)
        return result.epsilon, result.metrics["eval_perplexity"], [p.detach().clone() for p in result.model.parameters()
                                                                  if p.requires_grad]

    cfg = make_cfg("experiment=lm_lora", f"shard={shard}", "max_steps=20", "backend=gloo", "tracking=off")
    (eps0, ppl0, params0), (eps1, ppl1, params1) = launch_distributed(job, 2, cfg)
    assert eps0 == eps1 <= 8.0 and ppl0 == ppl1 < 40
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))  # identical adapters on both ranks
