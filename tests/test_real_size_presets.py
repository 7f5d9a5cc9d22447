"""Issue 24's benchmark presets (conf/experiment/bench_minilm.yaml, bench_gpt2_lora.yaml, bench_resnet18.yaml) are
built at real size by the config alone (no download) and take a DP step with max_physical_batch_size=auto. Sequences
are shortened here (the model is not): a step at 256 tokens is the benchmark's (benchmarks/real_size.py)."""

import pytest
import torch

from workbench.distributed import setup
from workbench.step import GradientStep

# preset -> (the model's real-size facts: trainable parameters, what its config says), overrides for a short batch
PRESETS = {
    "bench_minilm": (["data.train.length=16"], 10_700_000),  # encoder + pooler + head (embeddings frozen)
    "bench_gpt2_lora": (["data.train.length=16"], 290_000),  # the adapters only
    "bench_resnet18": ([], 11_100_000),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_real_size_preset_builds_and_takes_one_dp_step(name):
    from benchmarks.presets import preset

    extra, trainable = PRESETS[name]
    p = preset(name, 2, ("data.train.size=8", *extra))
    assert p.cfg.max_physical_batch_size == "auto"
    model = p.model()
    counted = sum(x.numel() for x in model.parameters() if x.requires_grad)
    assert trainable <= counted <= 1.1 * trainable, counted
    config = getattr(model, "config", None)
    if name == "bench_minilm":
        assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (6, 384, 30522)
        assert p.cfg.data.train.vocab == 30522 and p.cfg.data.train.num_classes == 2
    elif name == "bench_gpt2_lora":
        assert (config.n_layer, config.n_embd, config.vocab_size) == (6, 384, 50257)
        lora = {n.split(".lora_A")[0].rsplit(".", 1)[1] for n, _ in model.named_parameters() if "lora_A" in n}
        assert lora == {"c_attn", "c_proj", "c_fc"}  # attention and MLP
    else:
        assert sum(isinstance(m, torch.nn.GroupNorm) for m in model.modules()) == 20  # 2 per block, stem, 3 projections
        assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    step = GradientStep(model, p.criterion(reduction="none"), setup("gloo"), max_grad_norm=1.0, noise_multiplier=1.0,
                        grad_sample_mode="auto", max_physical_batch_size="auto", expected_batch=2)
    first = p.first_examples(2)
    step.check(first)
    step.size_micro_batches(first)
    assert 1 <= step.max_physical_batch_size <= 4  # auto's start for an expected batch of 2
    loss_sum, count = step(first, 0)
    assert count == 2 and torch.isfinite(step.update).all() and float(step.update.abs().sum()) > 0
