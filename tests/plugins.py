"""User-style plug-ins (Hydra `_target_`s) that tests need."""

import os
import signal

import torch

from workbench.data import Synthetic


class DyingSynthetic(Synthetic):
    """Synthetic data whose process is SIGKILLed at the Nth batch fetch when $WB_KILL_AT_FETCH=N: a hard crash
    mid-training (as a node failure would be), at a deterministic step. Without the variable it is plain Synthetic."""

    fetches = 0

    def __getitems__(self, indices):
        DyingSynthetic.fetches += 1
        if os.environ.get("WB_KILL_AT_FETCH") == str(DyingSynthetic.fetches):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitems__(indices)


class SlowSynthetic(Synthetic):
    """Synthetic data that takes $WB_FETCH_SLEEP seconds per batch: a long-enough run to interrupt, same numbers."""

    def __getitems__(self, indices):
        import time

        time.sleep(float(os.environ.get("WB_FETCH_SLEEP", "0")))
        return super().__getitems__(indices)


def broken_metrics(pred):
    """A compute_metrics that fails at eval time, after the run has started."""
    raise ValueError("metric exploded")


def batchnorm_mlp(in_features=64, hidden=(128,), num_classes=10):
    """A model DP-SGD must refuse: BatchNorm mixes the examples of a batch."""
    from torch import nn

    return nn.Sequential(nn.Linear(in_features, hidden[0]), nn.BatchNorm1d(hidden[0]), nn.ReLU(),
                         nn.Linear(hidden[0], num_classes))


def lone_groupnorm_mlp(in_features=64, hidden=32, num_classes=10):
    """A model that cannot learn: GroupNorm(C, C) on (N, C) features normalises each value alone (always 0)."""
    from torch import nn

    return nn.Sequential(nn.Linear(in_features, hidden), nn.GroupNorm(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))


def functional_weight_mlp(in_features=64, hidden=(128,), num_classes=10):
    """A model per-sample clipping would get wrong: the first layer's weight is also used outside that layer's call,
    which no layer-level check can see (grad_sample_mode=bk refuses it on a real batch before training)."""
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.head = nn.Linear(in_features, hidden[0]), nn.Linear(hidden[0], num_classes)

        def forward(self, x):
            return self.head(self.fc(x).relu() + x @ self.fc.weight.T)

    return Model()


def width_net(width: int = 2, num_classes: int = 10):
    """A user's own model with its own keyword arguments (``model._target_=tests.plugins.width_net +model.width=3``)."""
    from torch import nn

    return nn.Sequential(nn.Linear(64, width), nn.Tanh(), nn.Linear(width, num_classes))


def tiny_blobs(count: int = 300, split_seed: int = 0):
    """A user's own dataset with its own arguments (``data.train._target_=tests.plugins.tiny_blobs +data.train.count=...``)."""
    from workbench.data import Synthetic

    return Synthetic(size=count, seed=split_seed)


class FlawedSynthetic(Synthetic):
    """Synthetic data with one planted flaw, as a user's real data might have: `nan_input` or `inf_input` at example
    `at`, a `negative_label` there, or `float_labels` throughout."""

    def __init__(self, flaw: str, at: int = 0, **kwargs):
        super().__init__(**kwargs)
        x, y = self.tensors
        if flaw in ("nan_input", "inf_input"):
            x[at, 3] = float("nan") if flaw == "nan_input" else float("inf")
        elif flaw == "negative_label":
            y[at] = -3
        elif flaw == "float_labels":
            y = y.float()
        self.tensors = (x, y)


class PoisonedSynthetic(Synthetic):
    """Synthetic data whose batches turn to NaN from the `poison_from`-th batch fetch on (one fetch per training step),
    past anything a pre-run check reads: a run that goes bad mid-training."""

    def __init__(self, poison_from: int, **kwargs):
        super().__init__(**kwargs)
        self.poison_from, self.fetches = poison_from, 0

    def __getitems__(self, indices):
        self.fetches += list(indices) != list(range(len(indices)))  # pre-run checks read the first examples: not a step
        x, y = super().__getitems__(indices)
        return (x * float("nan"), y) if self.fetches >= self.poison_from else (x, y)


class RecordingSynthetic(Synthetic):
    """Synthetic data that records every index list it is asked for (in order), so a test can see the realised
    Poisson batches of an in-process run."""

    fetched: list = []

    def __getitems__(self, indices):
        RecordingSynthetic.fetched.append(list(indices))
        return super().__getitems__(indices)


class FailingSynthetic(Synthetic):
    """Synthetic data that raises at its Nth batch fetch when $WB_FAIL_AT_FETCH=N: an in-process crash mid-training at
    a deterministic step (counted per instance, so each run counts afresh)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fetches = 0

    def __getitems__(self, indices):
        self.fetches += 1
        if os.environ.get("WB_FAIL_AT_FETCH") == str(self.fetches):
            raise RuntimeError(f"injected failure at fetch {self.fetches}")
        return super().__getitems__(indices)


class DivergingSGD(torch.optim.SGD):
    """SGD (an optimizer `_target_`, partial) whose learning rate turns infinite at its `diverge_at`-th step: a run
    whose parameters diverge mid-training, whatever its data."""

    def __init__(self, params, diverge_at: int = 5, **kwargs):
        super().__init__(params, **kwargs)
        self.diverge_at, self.steps = diverge_at, 0

    def step(self, closure=None):
        self.steps += 1
        if self.steps == self.diverge_at:
            for group in self.param_groups:
                group["lr"] = float("inf")
        return super().step(closure)


class ModulesAtExit:
    """A callback that, when the job's process exits, writes which of MLflow and matplotlib it imported to
    ``modules-at-exit.txt`` in the working folder (a CLI job draws and sends through its tracking worker instead)."""

    def __init__(self):
        import atexit

        atexit.register(self._write)

    def on_train_end(self, state):
        pass

    @staticmethod
    def _write():
        import sys
        from pathlib import Path

        Path("modules-at-exit.txt").write_text(" ".join(m for m in ("mlflow", "matplotlib") if m in sys.modules))


class LateFlawData(torch.utils.data.Dataset):
    """A streamed dataset (read example by example, nothing in memory for a full scan) whose examples from index
    `bad_from` on carry a `flaw` the pre-run check cannot see, as a user's data on disk might: `label` (12 of 10
    classes), `width` (32 features for a 64-wide model) or `unreadable` (reading it raises)."""

    def __init__(self, flaw: str, bad_from: int = 100, size: int = 2048, seed: int = 0):
        self.inner, self.flaw, self.bad_from = Synthetic(size=size, seed=seed), flaw, bad_from

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        x, y = self.inner.tensors[0][i], self.inner.tensors[1][i]
        if i >= self.bad_from:
            if self.flaw == "unreadable":
                raise ValueError(f"record {i}: bad CRC")
            x, y = (x[:32], y) if self.flaw == "width" else (x, torch.tensor(12))
        return x, y
