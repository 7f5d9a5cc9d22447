"""The bad-model collection: every refusal names the real cause (the module path and the model's own error, a layer
that mixes examples, an output nothing can read, data that really does not fit) and never tells the user to change
data that is fine."""

import pytest
import torch
from torch import nn

from workbench.data.checks import check_fit
from workbench.distributed import setup
from workbench.errors import WorkbenchError
from workbench.models import prepare_model
from workbench.step import GradientStep

DATA_BLAME = ("does not fit the model", "make the model take inputs of shape (64,)", "model.in_features")


class Picky(nn.Module):
    def forward(self, x):
        raise NotImplementedError("We currently do not support causal mask")


class RaisesInside(nn.Module):
    """A model that raises its own error on a correct input, two modules deep."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 16)
        self.block = nn.Sequential(nn.Tanh(), Picky())

    def forward(self, x):
        return self.block(self.fc(x))


class InnerShapeBug(nn.Module):
    """The data fits the first layer; the second was built for another width."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 32), nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class ReturnsNone(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        self.fc(x)


class ReturnsDict(ReturnsNone):
    def forward(self, x):
        return {"scores": self.fc(x)}


class SumsTheBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.pool = nn.Linear(64, 10), Pool()

    def forward(self, x):
        return self.pool(self.fc(x))


class Pool(nn.Module):
    def forward(self, x):
        return x.mean(0, keepdim=True)


class FixedBatch(nn.Module):
    """Assumes one example per call: reshapes the batch away."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(x.reshape(1, -1))


class Center(nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class MixesExamples(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.center, self.head = nn.Linear(64, 16), Center(), nn.Linear(16, 10)

    def forward(self, x):
        return self.head(torch.tanh(self.center(self.fc(x))))


class SharedPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.pos, self.head = nn.Linear(8, 16), nn.Embedding(8, 16), nn.Linear(16, 10)

    def forward(self, x):
        h = self.fc(x.reshape(len(x), 8, 8)) + self.pos(torch.arange(8))
        return self.head(torch.tanh(h).mean(1))


def _data(width=64, n=16):
    torch.manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, width), torch.randint(0, 10, (n,)))


def _refusal(model, width=64):
    with pytest.raises(WorkbenchError) as err:
        check_fit(_data(width), "data.train (d)", model, nn.CrossEntropyLoss(reduction="none"), torch.device("cpu"))
    message = str(err.value)
    assert "\n" not in message
    return message


def _blames_no_data(message):
    assert not any(s in message for s in DATA_BLAME), message


def test_a_model_that_raises_its_own_error_is_named_with_its_error_and_the_data_is_not_blamed():
    message = _refusal(RaisesInside())
    assert "model.block.1 (Picky)" in message and "NotImplementedError: We currently do not support causal mask" in message
    assert "the model's own error, not the data's" in message and "fix model.block.1" in message
    _blames_no_data(message)


def test_a_layer_deep_in_the_model_that_cannot_take_its_input_is_named_with_the_shape_it_gets():
    message = _refusal(InnerShapeBug())
    assert message.startswith("data.train (d): model.fc2 (Linear) cannot take what the layers before it give it")
    assert "shape (32,) per example" in message and "make model.fc2 take inputs of shape (32,)" in message
    assert "in_features=32" in message
    _blames_no_data(message)


def test_data_that_really_does_not_fit_is_still_blamed_on_the_data_with_the_layer_that_reads_it():
    message = _refusal(nn.Sequential(nn.Linear(32, 10)))
    assert message.startswith("data.train (d): example 0 does not fit the model: mat1 and mat2 shapes")
    assert "(in model.0 (Linear))" in message and "make the model take inputs of shape (64,)" in message


@pytest.mark.parametrize("model, said", [(ReturnsNone(), "the model returned None (does its forward miss a `return`?)"),
                                         (ReturnsDict(), "the model returned a dict with keys ['scores']")])
def test_a_model_that_returns_nothing_usable_says_so_not_that_the_criterion_does_not_fit(model, said):
    message = _refusal(model)
    assert said in message and "does not fit the criterion" not in message
    _blames_no_data(message)


def test_an_output_without_one_row_per_example_names_the_layer_that_dropped_the_batch():
    message = _refusal(SumsTheBatch())
    assert "output has shape (1, 10) for a batch of 8 examples" in message and "model.pool (Pool)" in message
    assert "does not fit the criterion" not in message
    _blames_no_data(message)


def test_a_model_that_only_fails_on_batches_is_not_blamed_on_example_0():
    message = _refusal(FixedBatch())
    assert message.startswith("data.train (d): the model fails on a batch of 8 examples but runs on each example alone")
    assert "model.fc (Linear)" in message and "example 0" not in message
    _blames_no_data(message)


def test_batch_norm_without_fix_model_is_refused_with_its_path_and_a_fix_that_works():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.BatchNorm1d(4)), nn.Linear(4, 2))
    with pytest.raises(WorkbenchError) as err:
        prepare_model(model, private=True, fix=False)
    message = str(err.value)
    assert message.startswith("model.1.0 (BatchNorm1d) mixes examples across the batch")
    assert "privacy.fix_model=true" in message and len(message) < 400
    fixed, notes = prepare_model(model, private=True, fix=True)  # the fix named works
    assert notes == ["1.0: BatchNorm1d -> GroupNorm (re-initialised)"]


def _step_refusal(model, mode, x):
    step = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=1.0,
                        noise_multiplier=0.0, grad_sample_mode=mode)
    with pytest.raises(WorkbenchError) as err:
        step.check((x, torch.randint(0, 10, (len(x),))))
    return str(err.value)


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_the_pre_run_check_names_the_module_that_mixes_examples(mode):
    message = _step_refusal(MixesExamples(), mode, torch.randn(8, 64))
    assert f"grad_sample_mode={mode}" in message
    assert "the model mixes examples in model.center (Center):" in message and "no mean, sum" in message


def test_the_pre_run_check_names_a_layer_fed_without_a_batch_dimension():
    # hooks (bk expands ids shared by the batch per example and clips them: tests/test_attention.py)
    message = _step_refusal(SharedPositions(), "hooks", torch.randn(8, 64))
    assert "model.pos (Embedding) is called on an input of shape (8,) that has no batch dimension" in message
    assert "grad_sample_mode=auto" in message and "torch.arange(T).expand(B, T)" in message
