"""max_physical_batch_size=auto (workbench/step.py): the micro-batch size is found (CPU: from a memory budget before
training; CUDA: halved on an out-of-memory error, the step restarted from the same drawn batch), and the privacy of a
step never depends on it. An out-of-memory error is injected on CPU through GradientStep.fault, where a GPU would
raise it."""

import pytest
import torch
from torch import nn

from workbench.distributed import setup
from workbench.errors import WorkbenchError
from workbench.step import GradientStep, auto_start

OOM = torch.cuda.OutOfMemoryError


def _oom_above(limit: int, first_fits: bool):
    """A fault raising out-of-memory on micro-batches of more than ``limit`` examples; ``first_fits``: only from the
    second micro-batch of an attempt on, so the failed attempt has already accumulated a partial sum."""
    hits = []

    def fault(index: int, size: int) -> None:
        if size > limit and (index >= 1 or not first_fits):
            hits.append(size)
            raise OOM(f"injected: {size} examples")

    fault.hits = hits
    return fault


def _step(physical, fault=None, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=0.3,
                        noise_multiplier=1.0, grad_sample_mode="hooks", max_physical_batch_size=physical,
                        expected_batch=32, **kwargs)
    step.noise_seed = 1234
    step.fault = fault
    return step


def _batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(n, 6, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)) for n in (100, 41, 70)]


def test_out_of_memory_restarts_the_step_from_the_same_batch_and_equals_the_smaller_size_from_the_start():
    """auto starts at 64 (twice the expected 32); the second micro-batch of step 0 runs out of memory after the first
    one's clipped sum is in the buffer. The step restarts at 32 from the same batch: every update (noise included,
    from the same stream position), loss sum and count is bit-identical to a run at 32 from the start with the same
    public clip margins (those of 64: auto never lowers them, so they never depend on a realised batch size), and the
    size is remembered: later steps never try 64 again."""
    assert auto_start(32) == 64
    fault = _oom_above(32, first_fits=True)
    auto, fixed = _step("auto", fault), _step(32)
    fixed.clipper.max_batch = auto.bound_batch  # the same public margins as auto's start
    for t, batch in enumerate(_batches()):
        got, want = auto(batch, t), fixed(batch, t)
        assert got == want  # (loss sum, example count), the count once per example: nothing counted twice
        assert torch.equal(auto.update, fixed.update)
        assert float(auto.update.abs().sum()) > 0
    assert fault.hits == [36] and auto.max_physical_batch_size == 32 and auto.bound_batch == 64
    nothing_left = [p for p in auto.params if p.grad_sample is not None]
    assert not nothing_left


def test_out_of_memory_at_one_example_is_one_line_and_a_fixed_size_is_never_changed():
    with pytest.raises(WorkbenchError, match="one example does not fit in memory"):
        _step("auto", _oom_above(0, first_fits=False))(_batches()[0], 0)
    with pytest.raises(OOM):  # a fixed size is the user's: the error is theirs to see
        _step(32, _oom_above(16, first_fits=False))(_batches()[0], 0)


def test_cpu_budget_rule_and_its_refusals(make_cfg):
    """floor(budget / one example's cost), capped at the public start; a budget below one example is refused."""
    step = _step("auto", physical_batch_memory=0.05)
    batch = _batches()[0]
    per_example = step.example_bytes(step._to_device(batch))
    assert per_example >= step.numel * 4  # hooks holds each example's gradient of every parameter
    step.size_micro_batches(batch)
    assert step.max_physical_batch_size == step.bound_batch == step.clipper.max_batch == int(0.05 * 2**20 // per_example)
    with pytest.raises(WorkbenchError, match="one example needs about"):
        _step("auto", physical_batch_memory=1e-6).size_micro_batches(batch)
    from workbench.config import validate

    with pytest.raises(WorkbenchError, match="max_physical_batch_size must be a number or auto, got 'big'"):
        validate(make_cfg("max_physical_batch_size=big"))
    with pytest.raises(WorkbenchError, match="physical_batch_memory must be > 0"):
        validate(make_cfg("max_physical_batch_size=auto", "physical_batch_memory=0"))
    with pytest.raises(WorkbenchError, match="privacy.unit=user does not support max_physical_batch_size=auto"):
        validate(make_cfg("experiment=users", "max_physical_batch_size=auto"))


def test_auto_runs_equal_fixed_size_runs_bit_for_bit_through_the_whole_job(make_cfg, mlflow_uri, monkeypatch, capsys):
    """Whole in-process jobs (real sampler, noise, accountant, SQLite MLflow): auto under a memory budget trains
    exactly as the size it chose, fixed from the start, and logs that size; an out-of-memory error mid-step (after a
    partial sum) gives exactly the run whose error came before any sum, with the same batches and epsilon."""
    from mlflow import MlflowClient

    from tests.plugins import RecordingSynthetic
    from workbench import train

    common = ["experiment=quick", "max_steps=3", "data.eval=null", "privacy.grad_sample_mode=hooks", "privacy.secure_seed=3",
              "data.train._target_=tests.plugins.RecordingSynthetic"]

    def run(*extra, fault=None):
        monkeypatch.setattr(GradientStep, "fault", staticmethod(fault) if fault else None)
        RecordingSynthetic.fetched = []
        result = train(make_cfg(*common, *extra))
        return result, [p.detach().clone() for p in result.model.parameters()], list(RecordingSynthetic.fetched)

    auto, auto_params, drawn = run("max_physical_batch_size=auto", "physical_batch_memory=1")
    chosen = int(MlflowClient(tracking_uri=mlflow_uri).get_run(auto.run_id).data.tags["physical_batch_size"])
    assert 1 < chosen < 64  # the budget bit: the expected batch is 64, drawn batches split into micro-batches
    assert f"max_physical_batch_size=auto: {chosen} examples per micro-batch" in capsys.readouterr().out
    fixed, fixed_params, fixed_drawn = run(f"max_physical_batch_size={chosen}", "tracking.enabled=false")
    assert fixed_drawn == drawn and fixed.epsilon == auto.epsilon
    assert all(torch.equal(a, b) for a, b in zip(auto_params, fixed_params))

    budget = ("max_physical_batch_size=auto", "physical_batch_memory=1", "tracking.enabled=false")
    half = chosen // 2
    late = _oom_above(half, first_fits=True)
    partial, partial_params, partial_drawn = run(*budget, fault=late)
    early = _oom_above(half, first_fits=False)
    clean, clean_params, clean_drawn = run(*budget, fault=early)
    assert late.hits == [chosen] and early.hits == [chosen]  # once each, then remembered
    assert partial_drawn == clean_drawn == drawn and partial.epsilon == clean.epsilon == auto.epsilon
    assert all(torch.equal(a, b) for a, b in zip(partial_params, clean_params))
    assert not all(torch.equal(a, b) for a, b in zip(partial_params, auto_params))  # the halving did happen


def test_a_resumed_auto_run_keeps_its_size_and_margins_and_ends_bit_exact(make_cfg, tmp_path, monkeypatch):
    """A run that halved its size at step 0 crashes in step 4; resumed with another memory budget (its probe alone would
    choose another size and other margins), it takes the checkpoint's and ends exactly where an uninterrupted run does."""
    from workbench import checkpoint, train

    args = ["experiment=quick", "data.train._target_=tests.plugins.FailingSynthetic", "max_steps=6", "save_steps=3",
            "data.eval=null", "privacy.grad_sample_mode=hooks", "privacy.secure_seed=5", "max_physical_batch_size=auto",
            "tracking.enabled=false"]
    monkeypatch.setattr(GradientStep, "fault", staticmethod(_oom_above(13, first_fits=False)))
    crashed = tmp_path / "crashed"
    monkeypatch.setenv("WB_FAIL_AT_FETCH", "6")  # the pre-run check's fetch, then steps 0..3: fails in step 4
    with pytest.raises(RuntimeError, match="injected failure"):
        train(make_cfg(*args, "physical_batch_memory=1", f"output_dir={crashed}"))
    monkeypatch.delenv("WB_FAIL_AT_FETCH")
    kept = checkpoint.load(checkpoint.list_checkpoints(crashed)[-1])["physical_batch_size"]
    assert kept[0] < kept[1]  # halved below its margins' size
    resumed = train(make_cfg(*args, "physical_batch_memory=2", f"output_dir={crashed}", "resume_from_checkpoint=latest"))
    whole = train(make_cfg(*args, "physical_batch_memory=1", f"output_dir={tmp_path / 'whole'}"))
    assert resumed.steps == whole.steps == 6 and resumed.epsilon == whole.epsilon
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), whole.model.parameters()))
