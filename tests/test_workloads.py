"""Real workloads through the same trainer: batch shapes, model outputs, token losses, module fixing, mixed precision,
a user's own model and data in one override. Every path is checked against a per-example autograd loop."""

import math

import pytest
import torch
from mlflow import MlflowClient
from torch import nn

from tests.oracle import clipped_sum, rows
from workbench.data import Batch, PadCollator, as_batch, collate
from workbench.distributed import setup
from workbench.errors import WorkbenchError
from workbench.losses import TokenCrossEntropy
from workbench.models import LSTMClassifier, TransformerClassifier, prepare_model
from workbench.evaluation import Evaluator
from workbench.step import GradientStep


class _Out:
    """An HF-style output object: the trainer must read .logits."""

    def __init__(self, logits):
        self.logits = logits


class _TwoInputs(nn.Module):
    """forward(a, b): positional (x1, x2, y) batches and keyword (mapping) batches alike; returns an object."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fa, self.fb, self.head = nn.Linear(6, 8), nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, a, b):
        return _Out(self.head(torch.tanh(self.fa(a) + self.fb(b))))


def _data(n=13, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g) * 3, torch.randn(n, 4, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def _assert_grads(step, expected):
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["bk", "hooks", "functorch", "ew"])
@pytest.mark.parametrize("shape", ["positional", "mapping"])
def test_multi_input_and_mapping_batches_match_the_per_example_loop(mode, shape):
    a, b, y = _data()
    raw = (a, b, y) if shape == "positional" else {"a": a, "b": b, "labels": y}
    expected = clipped_sum(_TwoInputs(), rows(a, b, y), 0.5).grads  # reads the output's .logits
    step = GradientStep(_TwoInputs(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=0.5,
                        noise_multiplier=0.0, grad_sample_mode=mode, max_physical_batch_size=4)  # 4 micro-batches
    step.check(raw)
    loss_sum, count = step(raw, step=0)
    assert count == len(y) and loss_sum > 0
    _assert_grads(step, expected)


def test_batch_shapes_are_read_alike_and_bad_ones_refused():
    x, y = torch.randn(5, 3), torch.arange(5)
    assert as_batch((x, y)).args[0] is x and len(as_batch((x, y))) == 5
    mapping = as_batch({"input_ids": x, "attention_mask": x, "label": y})  # HF datasets' "label" too
    assert set(mapping.kwargs) == {"input_ids", "attention_mask"} and mapping.labels is y
    part = as_batch({"input_ids": x, "shared": torch.zeros(1, 3), "labels": y}).slice(1, 3)
    assert torch.equal(part.kwargs["input_ids"], x[1:3]) and part.kwargs["shared"].shape == (1, 3)
    assert as_batch(None) is None
    with pytest.raises(WorkbenchError, match="needs a 'labels' entry"):
        as_batch({"input_ids": x})
    with pytest.raises(WorkbenchError, match=r"\(x, y\), \(x1, ..., xk, y\) or a mapping"):
        as_batch(x)


def test_an_empty_mapping_draw_still_takes_the_step():
    step = GradientStep(_TwoInputs(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=1.0,
                        noise_multiplier=1.0, grad_sample_mode="hooks")
    empty = {"a": torch.empty(0, 6), "b": torch.empty(0, 4), "labels": torch.empty(0, dtype=torch.long)}
    loss_sum, count = step(empty, step=0)
    assert count == 0 and loss_sum == 0
    noise_only = torch.cat([p.grad.flatten() for p in step.params]).clone()
    step(None, step=0)  # the sampler's empty draw: the same noise, nothing else
    assert torch.equal(torch.cat([p.grad.flatten() for p in step.params]), noise_only)
    assert collate([]) is None


class _TinyLM(nn.Module):
    """Embedding -> tanh Linear -> vocabulary logits, HF style: forward(input_ids, attention_mask) -> .logits."""

    def __init__(self, vocab=11, width=8, freeze_embedding=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix, self.out = nn.Embedding(vocab, width), nn.Linear(width, width), nn.Linear(width, vocab)
        self.emb.requires_grad_(not freeze_embedding)

    def forward(self, input_ids, attention_mask=None):
        h = torch.tanh(self.mix(self.emb(input_ids)))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return _Out(self.out(h))


def _text(lengths=(5, 2, 7, 3, 6, 1, 4), vocab=11, seed=3):
    """Variable-length sequences, labels = input_ids (causal LM), some tokens ignored, padded by PadCollator."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,), generator=g)
        labels = ids.clone()
        labels[0] = -100 if n > 2 else labels[0]  # e.g. a prompt token that is not trained on
        examples.append({"input_ids": ids, "attention_mask": torch.ones(n, dtype=torch.long), "labels": labels})
    return examples


def test_pad_collator_pads_each_key_with_its_own_value():
    batch = PadCollator(pad_token_id=9, pad_to_multiple_of=4)(
        [{"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1], "labels": [1, 2, 3], "label": 1},
         {"input_ids": [4], "attention_mask": [1], "labels": [4], "label": 0}])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 9], [4, 9, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3, -100], [4, -100, -100, -100]]
    assert batch["label"].tolist() == [1, 0]
    with pytest.raises(WorkbenchError, match="mappings"):
        PadCollator()([(torch.zeros(2), 1)])


def test_token_loss_is_each_examples_mean_over_its_own_tokens():
    examples = _text()
    model, loss = _TinyLM(), TokenCrossEntropy()
    batch = as_batch(PadCollator()(examples))
    losses = loss(model(**batch.kwargs).logits, batch.labels)
    for i, e in enumerate(examples):  # alone, unpadded: the same value (padding and the batch change nothing)
        alone = model(e["input_ids"][None]).logits[0, :-1]
        targets = e["labels"][1:]
        own = nn.functional.cross_entropy(alone[targets != -100], targets[targets != -100]) \
            if (targets != -100).any() else torch.tensor(0.0)
        torch.testing.assert_close(losses[i], own)
    assert losses[5] == 0  # one token: nothing to predict, no gradient
    with pytest.raises(WorkbenchError, match="reduction must be 'none'"):
        TokenCrossEntropy(reduction="mean")


@pytest.mark.parametrize("mode,frozen", [("bk", True), ("hooks", False), ("ew", False), ("auto", False)])
def test_token_level_lm_clipping_matches_the_per_example_loop(mode, frozen):
    examples = _text()
    loss = TokenCrossEntropy()

    def one(model, e):
        return loss(model(e["input_ids"][None], e["attention_mask"][None]).logits, e["labels"][None])[0]

    make = lambda: _TinyLM(freeze_embedding=frozen)  # noqa: E731 - bk clips nn.Linear only
    expected = clipped_sum(make(), examples, 0.05, one).grads
    step = GradientStep(make(), loss, setup("gloo"), max_grad_norm=0.05, noise_multiplier=0.0, grad_sample_mode=mode,
                        max_physical_batch_size=3)
    raw = PadCollator()(examples)
    step.check(raw)
    _, count = step(raw, step=0)
    assert count == len(examples)
    _assert_grads(step, expected)


def test_a_parameter_without_per_example_gradients_is_refused():
    class SharedPositions(nn.Module):  # BERT-style position embeddings looked up with (1, T) ids
        def __init__(self):
            super().__init__()
            self.pos, self.head = nn.Embedding(8, 4), nn.Linear(4, 3)

        def forward(self, x):
            return self.head((x.unsqueeze(-1) + self.pos(torch.arange(x.shape[1])[None])).mean(1))

    for mode in ("hooks",):
        step = GradientStep(SharedPositions(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=1.0,
                            noise_multiplier=0.0, grad_sample_mode=mode)
        with pytest.raises(WorkbenchError, match="'pos.weight' has no per-example gradient"):
            step((torch.randn(5, 6), torch.randint(0, 3, (5,))), step=0)


@pytest.mark.parametrize("batched", [False, True])
def test_evaluator_gathers_ragged_lm_logits_and_reports_perplexity(batched):
    examples = _text()
    model = _TinyLM()
    batches = [PadCollator()(examples[:3]), PadCollator()(examples[3:])]  # padded to 7, then to 6 tokens
    seen = []

    def metrics(pred, compute_result=True):
        seen.append(pred)
        return {"n": float(len(pred.label_ids))}

    ev = Evaluator(model, TokenCrossEntropy(), batches, setup("gloo"), metrics, batch_eval_metrics=batched)
    out = ev()
    loss = TokenCrossEntropy()
    with torch.no_grad():
        per_example = torch.cat([loss(model(**as_batch(b).kwargs).logits, b["labels"]) for b in batches])
    assert out["eval_loss"] == pytest.approx(float(per_example.mean()), rel=1e-6)
    assert out["eval_perplexity"] == pytest.approx(float(per_example.mean().exp()), rel=1e-6)
    if batched:
        assert [len(p.label_ids) for p in seen] == [3, 4]
    else:
        (pred,) = seen
        assert pred.predictions.shape == (7, 7, 11) and pred.label_ids.shape == (7, 7)
        assert (pred.label_ids[3:, 6] == -100).all()  # the shorter batch padded as HF pads: -100
        with torch.no_grad():
            torch.testing.assert_close(pred.predictions[3:, :6], model(**as_batch(batches[1]).kwargs).logits)


def test_models_dp_cannot_handle_are_refused_with_a_fix():
    with pytest.raises(WorkbenchError, match="BatchNorm.*privacy.fix_model=true replaces it"):
        prepare_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), private=True, fix=False)
    prepare_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), private=False, fix=False)
    with pytest.raises(WorkbenchError, match="launcher=local"):
        prepare_model(nn.DataParallel(nn.Linear(4, 4)), private=False)


def test_fixed_transformer_and_lstm_keep_their_function_and_clip_exactly():
    x = torch.rand(9, 64)
    y = torch.randint(0, 10, (9,))
    for cls, expect in ((TransformerClassifier, "MultiheadAttention -> PerExampleMultiheadAttention (weights carried)"),
                        (LSTMClassifier, "LSTM -> DPLSTM (weights carried)")):
        torch.manual_seed(0)
        original = cls().eval()
        before = original(x)
        fixed, notes = prepare_model(original, private=True)
        assert len(notes) == 1 and expect in notes[0]
        torch.testing.assert_close(fixed.eval()(x), before)  # same weights, same function (batch_first included)
        fixed.train()
        with pytest.raises(WorkbenchError, match="fix_model=true replaces it"):
            prepare_model(cls(), private=True, fix=False)

        def again():
            torch.manual_seed(1)
            return prepare_model(cls(), private=True)[0]

        expected = clipped_sum(again(), rows(x, y), 0.1).grads
        step = GradientStep(again(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=0.1,
                            noise_multiplier=0.0, grad_sample_mode="auto", max_physical_batch_size=4)
        step((x, y), step=0)
        _assert_grads(step, expected)
    _, notes = prepare_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), private=True)
    assert notes == ["1: BatchNorm2d -> GroupNorm (re-initialised)"]


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_bf16_clipped_contributions_never_exceed_the_bound(mode):
    """Under bf16 autocast each example's contribution to the clipped sum has norm <= C up to float32 rounding:
    norms, factors and the sum are float32 and come from the very per-sample values summed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    dtypes = []
    model[0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    clip = 0.01  # every example is clipped
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=clip,
                        noise_multiplier=0.0, grad_sample_mode=mode, autocast_dtype=torch.bfloat16)
    x, y = torch.randn(16, 6) * 5, torch.randint(0, 3, (16,))
    total = None
    for i in range(len(y)):
        step((x[i:i + 1], y[i:i + 1]), step=0)
        contribution = torch.cat([p.grad.flatten() for p in step.params])
        assert contribution.dtype == torch.float32
        assert float(contribution.norm()) <= clip * (1 + 1e-5)
        assert float(contribution.norm()) >= clip * 0.99  # and it really was clipped
        total = contribution.clone() if total is None else total + contribution
    assert torch.bfloat16 in dtypes  # the forward ran in bf16
    step((x, y), step=1)
    assert float(torch.cat([p.grad.flatten() for p in step.params]).norm()) <= len(y) * clip * (1 + 1e-5)
    with pytest.raises(WorkbenchError, match="cannot run in mixed precision"):
        GradientStep(nn.Linear(6, 3), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=clip,
                     noise_multiplier=0.0, grad_sample_mode="ew", autocast_dtype=torch.bfloat16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here, so fp16 is allowed (CI has no GPU: it runs)")
def test_fp16_is_refused_without_cuda(make_cfg):
    from workbench import train

    with pytest.raises(WorkbenchError, match="fp16=true needs CUDA"):
        train(make_cfg("experiment=quick", "fp16=true"))


def test_own_model_and_data_in_one_override_each(make_cfg, mlflow_uri):
    """model._target_ and data.train._target_ swap the class; the old option's arguments are not passed to it."""
    from workbench import train

    result = train(make_cfg("experiment=quick", "model._target_=tests.plugins.width_net", "+model.width=3",
                            "data.train._target_=tests.plugins.tiny_blobs", "+data.train.count=320"))
    assert [p.shape for p in result.model.parameters()][:1] == [torch.Size([3, 64])]
    assert result.sample_rate == pytest.approx(64 / 320)
    with pytest.raises(WorkbenchError, match="unexpected keyword argument 'depth'"):  # user keys still checked
        train(make_cfg("experiment=quick", "model._target_=tests.plugins.width_net", "+model.depth=3"))


@pytest.mark.parametrize("bn, shape", [(nn.BatchNorm1d, (8, 32)), (nn.BatchNorm1d, (8, 32, 5)),
                                       (nn.BatchNorm2d, (8, 32, 3, 3)), (nn.BatchNorm3d, (8, 64, 2, 2, 2))])
def test_a_fixed_batch_norm_normalises_each_example_alone_and_keeps_its_information(bn, shape):
    """BatchNorm -> a GroupNorm that reads one example (its output is the same in any batch) and does not flatten it
    (Opacus' default GroupNorm(gcd(32, C), C) on 32 features normalises each value alone: every output 0)."""
    torch.manual_seed(0)
    model, notes = prepare_model(nn.Sequential(bn(shape[1])), private=True)
    assert notes == [f"0: {bn.__name__} -> GroupNorm (re-initialised)"]
    x = torch.randn(shape) * 3 + 1
    out = model(x)
    torch.testing.assert_close(out[:1], model(x[:1]))  # per example: no other example changes it
    values_per_group = shape[1] // model[0].num_groups * math.prod(shape[2:])
    assert values_per_group >= 4 and out.std() > 0.5  # normalised, not zeroed
    if bn is nn.BatchNorm1d:  # features: normalised across all of them (LayerNorm's statistics)
        assert model[0].num_groups == 1


def test_a_fixed_batch_norm_left_with_one_value_per_group_is_refused_in_one_line():
    """BatchNorm2d(4) on 1x1 maps: its GroupNorm(4, 4) would zero every value; the pre-run check names it and the fix."""
    from workbench.data.checks import check_fit

    model, _ = prepare_model(nn.Sequential(nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 3)), private=True)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, 1, 1), torch.randint(0, 3, (16,)))
    with pytest.raises(WorkbenchError) as err:
        check_fit(data, "data.train", model, nn.CrossEntropyLoss(reduction="none"), torch.device("cpu"))
    assert str(err.value).startswith("model.0: GroupNorm(4, 4") and "(8, 4, 1, 1) alone" in str(err.value)
    assert "torch.nn.GroupNorm(1, 4)" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_an_mlp_with_batch_norm_is_fixed_into_one_that_learns(make_cfg, mlflow_uri, mode):
    """BatchNorm1d over 32 hidden features: the fixed model trains to far above chance (0.1) in both modes."""
    from workbench import train

    result = train(make_cfg("experiment=quick", "model._target_=tests.plugins.batchnorm_mlp", "+model.hidden=[32]",
                            f"privacy.grad_sample_mode={mode}", "privacy.secure_seed=1"))
    assert result.metrics["eval_accuracy"] > 0.8
    run = MlflowClient(tracking_uri=mlflow_uri).get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["fixed_modules"] == "1: BatchNorm1d -> GroupNorm (re-initialised)"


def test_bf16_transformer_trains_with_dp_and_records_the_replacement(make_cfg, mlflow_uri, capsys):
    from workbench import train

    result = train(make_cfg("data=digits", "model._target_=workbench.models.TransformerClassifier", "bf16=true",
                            "max_steps=30", "per_device_train_batch_size=128", "learning_rate=0.5",
                            "privacy.target_epsilon=8", "privacy.secure_seed=1"))  # pinned: one deterministic run
    assert "privacy.fix_model: encoder.layers.0.self_attn: MultiheadAttention -> PerExampleMultiheadAttention" in \
        capsys.readouterr().out
    tags = MlflowClient(tracking_uri=mlflow_uri).get_run(result.run_id).data.tags
    assert "MultiheadAttention -> PerExampleMultiheadAttention" in tags["fixed_modules"]
    assert result.epsilon <= 8 and result.metrics["eval_accuracy"] > 0.3  # 10 classes; learning, if slowly


def test_lstm_trains_with_dp_through_model_target(make_cfg, mlflow_uri, capsys):
    from workbench import train

    result = train(make_cfg("data=digits", "model._target_=workbench.models.LSTMClassifier", "max_steps=30",
                            "per_device_train_batch_size=128", "learning_rate=1.0", "privacy.target_epsilon=8",
                            "privacy.secure_seed=1"))  # pinned: one deterministic run
    assert "privacy.fix_model: lstm: LSTM -> DPLSTM (weights carried)" in capsys.readouterr().out
    tags = MlflowClient(tracking_uri=mlflow_uri).get_run(result.run_id).data.tags
    assert "LSTM -> DPLSTM" in tags["fixed_modules"]
    assert result.steps == 30 and result.epsilon <= 8 and result.metrics["eval_accuracy"] > 0.18  # chance: 0.1


def _frozen_encoder(weights=None):
    from workbench.models import frozen_backbone

    torch.manual_seed(3)
    return frozen_backbone(TransformerClassifier(), weights=weights)


def test_a_frozen_backbone_has_no_gradient_and_no_noise_and_its_head_clips_exactly():
    model = _frozen_encoder()
    head = [p for n, p in model.named_parameters() if n.startswith("head")]
    assert [p for p in model.parameters() if p.requires_grad] == head
    x, y = torch.rand(9, 64), torch.randint(0, 10, (9,))
    expected = clipped_sum(_frozen_encoder(), rows(x, y), 0.1).grads
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=0.1,
                        noise_multiplier=0.0, grad_sample_mode="auto", max_physical_batch_size=4)
    assert step.mode == "bk" and step.numel == sum(p.numel() for p in head)  # the noise's dimension: the head's
    step.check((x, y))
    step((x, y), step=0)
    _assert_grads(step, expected)
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("head"))
    with pytest.raises(WorkbenchError, match="model.trainable='classifier' matches no parameter"):
        from workbench.models import frozen_backbone

        frozen_backbone(TransformerClassifier(), trainable=["classifier"])


def test_frozen_backbone_with_pretrained_weights_trains_its_head_with_dp_and_rebuilds_from_its_checkpoint(
        make_cfg, tmp_path):
    from workbench import train
    from workbench.checkpoint import load

    torch.manual_seed(11)
    pretrained = TransformerClassifier().state_dict()
    torch.save(pretrained, tmp_path / "encoder.pt")
    result = train(make_cfg("data=digits", "model._target_=workbench.models.frozen_backbone",
                            "+model.model._target_=workbench.models.TransformerClassifier",
                            f"+model.weights={tmp_path / 'encoder.pt'}", "max_steps=10",
                            "per_device_train_batch_size=128", "learning_rate=1.0", "privacy.target_epsilon=8"))
    assert result.epsilon <= 8 and result.steps == 10
    trained = result.model.state_dict()
    for name, value in pretrained.items():  # the backbone is the pre-trained one, bit for bit; the head moved
        assert torch.equal(trained[name], value) != name.startswith("head"), name
    rebuilt = _frozen_encoder(weights=str(tmp_path / "encoder.pt"))
    rebuilt.load_state_dict(load(result.checkpoint)["model"])
    x = torch.rand(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(x), result.model.eval()(x))
    with pytest.raises(WorkbenchError, match="is not a file"):
        train(make_cfg("data=digits", "model._target_=workbench.models.frozen_backbone",
                       "+model.model._target_=workbench.models.TransformerClassifier", "+model.weights=missing.pt"))


def test_default_job_imports_no_hugging_face(tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import sys; from workbench import compose, train; "
            f"train(compose(['experiment=quick', 'tracking=off', 'output_dir={tmp_path}/run', 'disable_tqdm=true'])); "
            "print(sorted(m for m in ('transformers', 'peft', 'tokenizers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_cuda_step_matches_the_per_example_loop(dtype):
    """Device placement, non_blocking copies from pinned memory and autocast on CUDA: the clipped sum is the CPU
    per-example loop's (to half-precision rounding), each example's contribution bounded in float32."""
    a, b, y = _data()
    raw = {"a": a.pin_memory(), "b": b.pin_memory(), "labels": y.pin_memory()}
    expected = clipped_sum(_TwoInputs(), rows(a, b, y), 0.5).grads  # reads the output's .logits
    d = setup("gloo")
    # fp16: a loss scale these magnitudes keep finite (at a larger one an example may overflow and contribute 0:
    # tested below); none for bf16 and float32
    step = GradientStep(_TwoInputs().cuda(), nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=0.5,
                        noise_multiplier=0.0, grad_sample_mode="hooks", autocast_dtype=dtype,
                        loss_scale=2.0 ** 8 if dtype == torch.float16 else None)
    step(raw, step=0)
    step.divide_(1.0)  # divides by the loss scale S: the clipped sum itself
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype is None else dict(rtol=5e-2, atol=2e-2)
    for p, e in zip(step.params, expected):
        assert p.grad.is_cuda and p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.cpu().double(), e, **tolerance)


# fp16's fixed loss scale and the zeroing of an example whose backward overflows, in a real Trainer: on CPU in float32
# (a large scale and an outlier overflow float32 as fp16 overflows at 65504); the same in fp16 on CUDA: the gpu tests.

class _Lines:
    """Records the step lines the trainer sends (a stand-in for the tracker: this tests the trainer's own logic)."""

    def __init__(self):
        self.lines = []

    def log_many(self, lines):
        self.lines += lines

    def log_metrics(self, metrics, step=None):
        self.lines.append((metrics, step))

    def set_tags(self, tags):
        self.tags = {**getattr(self, "tags", {}), **tags}

    def flush(self):
        pass


class _Applied:
    """A callback: the steps whose update was applied."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, state):
        self.steps.append(state.step)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches(steps=4):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(12, 6, generator=g) * 3, torch.randint(0, 3, (12,), generator=g)) for _ in range(steps)]


def _scaled_run(scale, batches, *, start_step=0, device="cpu", autocast_dtype=None, mode="bk"):
    """A real Trainer on a real GradientStep (noise on, sigma=1), fed ``batches``; returns what the tests read."""
    from types import SimpleNamespace

    from workbench.callbacks import CallbackList
    from workbench.privacy import Accountant
    from workbench.privacy.mechanism import Mechanism
    from workbench.privacy.sampling import Shard
    from workbench.trainer import LoopConfig, Trainer

    steps = len(batches)
    model = _mlp().to(device)
    d = setup("gloo")
    step_fn = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), d, max_grad_norm=0.5, noise_multiplier=1.0,
                           grad_sample_mode=mode, noise_seed=7, autocast_dtype=autocast_dtype, loss_scale=scale)
    step_fn.check(_batches()[0])
    optimizer = torch.optim.SGD(step_fn.params, lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accountant = Accountant("pld", 0.1, 1.0)
    applied, tracker = _Applied(), _Lines()
    # N = 120, B = 12 (q = 0.1), C = 0.5, sigma = 1: the mechanism the loop reads its steps, B and spend from
    mechanism = Mechanism(Shard(range(120), 120, 0.1, 0, 12), "per_rank", 1, steps, 0.5, 1.0, 1e-5, accountant)
    loop = LoopConfig(start_step, logging_steps=1, eval_steps=0, save_steps=0, progress_bar=False,
                      log_train_loss=True)  # the tests below read the loss line
    trainer = Trainer(loop, d, mechanism, model, step_fn, optimizer, scheduler, batches[start_step:], lambda: {},
                      tracker, lambda s: None, CallbackList([applied], model, list(model.named_parameters()), steps))
    return SimpleNamespace(trainer=trainer, model=model, step_fn=step_fn, accountant=accountant, applied=applied,
                           tracker=tracker)


def test_fp16_scales_the_loss_by_a_fixed_scale_and_bf16_by_none():
    fp16 = GradientStep(_mlp(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=1.0,
                        noise_multiplier=1.0, autocast_dtype=torch.float16)
    assert fp16.scale == 2.0 ** 10  # fp16_loss_scale's default
    assert GradientStep(_mlp(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=1.0,
                        noise_multiplier=1.0, autocast_dtype=torch.float16, loss_scale=8.0).scale == 8.0
    bf16 = GradientStep(_mlp(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=1.0,
                        noise_multiplier=1.0, autocast_dtype=torch.bfloat16)
    assert bf16.scale == 1.0
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(WorkbenchError, match="loss scale must be a finite number > 0"):
            GradientStep(_mlp(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=1.0,
                         noise_multiplier=1.0, loss_scale=bad)


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_loss_scaled_updates_equal_the_unscaled_run_for_the_same_noise(mode):
    """Loss x S, clip to C*S, noise sigma*C*S, divide by S: DP-SGD's own update, so the trained parameters equal the
    unscaled run's."""
    plain = _scaled_run(None, _batches(), mode=mode)
    scaled = _scaled_run(2.0 ** 20, _batches(), mode=mode)
    assert plain.trainer.fit() == scaled.trainer.fit() == 4
    assert scaled.applied.steps == [1, 2, 3, 4]
    for p, q in zip(plain.model.parameters(), scaled.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    (loss_plain, _), (loss_scaled, _) = plain.tracker.lines[0], scaled.tracker.lines[0]
    assert loss_scaled["loss"] == pytest.approx(loss_plain["loss"], rel=1e-6)  # the logged loss is unscaled


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_an_overflowing_example_is_left_out_of_its_step_silently_and_the_run_goes_on(mode, caplog):
    """An outlier whose scaled backward overflows (its activations reach 1e30, the gradient at the logits S = 2**40:
    its per-sample gradient is past float32's range): every step is applied and counted, nothing is logged about it
    (the count is private). In hooks its float32 per-sample gradient is inf and it contributes 0: the run equals the
    one trained without that example (same noise); bk clips it in float64, where its gradient is finite."""
    batches = _batches()
    batches[1][0][3] *= 1e30
    scaled = _scaled_run(2.0 ** 40, batches, mode=mode)
    with caplog.at_level("DEBUG"):
        assert scaled.trainer.fit() == 4
    assert scaled.accountant.steps == 4 and scaled.applied.steps == [1, 2, 3, 4]
    assert {key for metrics, _ in scaled.tracker.lines for key in metrics} == {
        "loss", "learning_rate", "samples_per_second", "epoch", "epsilon"}
    assert not [r for r in caplog.records if r.name.startswith("workbench")]
    if mode == "bk":  # a and g are finite float32: its gradient is finite in float64, where it is clipped, not left
        # out (tests/test_fp_bound.py checks that contribution); hooks' per-sample gradient itself overflows float32
        assert all(bool(torch.isfinite(q).all()) for q in scaled.model.parameters())
        return
    without = _batches()
    without[1] = tuple(t[[i for i in range(12) if i != 3]] for t in without[1])
    plain = _scaled_run(None, without, mode=mode)
    plain.trainer.fit()
    for p, q in zip(plain.model.parameters(), scaled.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_fp16_on_cuda_leaves_an_overflowing_example_out_and_follows_the_float32_run_without_it(mode):
    """fp16's range ends at 65504: an outlier whose values pass it contributes 0 (not NaN); the rest of the run
    follows the float32 run trained without that example (same noise), to half-precision rounding."""
    batches = _batches()
    batches[1][0][3] *= 1e6  # past 65504 in fp16
    scaled = _scaled_run(None, batches, device="cuda", autocast_dtype=torch.float16, mode=mode)
    assert scaled.trainer.fit() == 4
    assert scaled.step_fn.scale == 2.0 ** 10 and scaled.applied.steps == [1, 2, 3, 4]
    assert scaled.step_fn.update.is_cuda and scaled.step_fn.update.dtype == torch.float32
    without = _batches()
    without[1] = tuple(t[[i for i in range(12) if i != 3]] for t in without[1])
    plain = _scaled_run(None, without, device="cuda", mode=mode)
    plain.trainer.fit()
    for p, q in zip(plain.model.parameters(), scaled.model.parameters()):
        assert q.is_cuda and q.dtype == torch.float32
        torch.testing.assert_close(q, p, rtol=5e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_job_trains_on_cuda(make_cfg, mlflow_uri):
    from workbench import train

    result = train(make_cfg("experiment=quick", "fp16=true", "logging_steps=1"))
    assert next(result.model.parameters()).is_cuda
    assert result.epsilon is not None and 0 < result.epsilon <= 8 + 1e-9
    assert result.metrics["eval_accuracy"] > 0.8  # float32 reaches 1.0 on this data; chance is 0.1
    client = MlflowClient(tracking_uri=mlflow_uri)
    logged = client.get_run(result.run_id).data.metrics
    assert "learning_rate" in logged and not {"skipped_steps", "loss_scale"} & set(logged)  # nothing about dropped examples


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_loader_pins_memory_and_noise_is_drawn_on_the_device_from_the_step_stream():
    from types import SimpleNamespace

    from workbench.data import train_loader
    from workbench.privacy.sampling import PoissonBatchSampler, train_shard

    cfg = SimpleNamespace(dataloader_num_workers=0, dataloader_pin_memory=True)
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    shard = train_shard(64, 0, 1, "per_rank", 16)
    (x, y), = list(train_loader(dataset, PoissonBatchSampler(shard, 1, seed=3, rank=0), cfg, torch.device("cuda")))
    assert x.is_pinned() and y.is_pinned()  # so GradientStep's non_blocking copies are asynchronous
    (x_cpu, _), = list(train_loader(dataset, PoissonBatchSampler(shard, 1, seed=3, rank=0), cfg, torch.device("cpu")))
    assert not x_cpu.is_pinned()
    sigma, clip = 1.3, 0.7
    step = GradientStep(nn.Linear(100, 50).cuda(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"),
                        max_grad_norm=clip, noise_multiplier=sigma, noise_seed=11)
    samples = []
    for s in range(20):
        step(None, step=s)  # an empty Poisson batch: pure noise, drawn on the GPU from (noise_seed, step)
        samples.append(step.update.clone())
    assert all(t.is_cuda and t.dtype == torch.float32 for t in samples)
    noise = torch.stack(samples)
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.02) and abs(float(noise.mean())) < 0.01
    step(None, step=3)
    assert torch.equal(step.update, samples[3])  # reproducible from the (secret-mixed) seed and the step alone
    assert not torch.equal(samples[3], samples[4])
