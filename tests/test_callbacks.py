"""Callbacks (workbench/callbacks.py): one built from config and one passed in see every step, and the update each
sees is the one the optimizer applied."""

import torch


class CountingCallback:
    """Built from config (callbacks=[{_target_: ...}]): records the steps it saw."""

    steps: list = []

    def on_step_end(self, state):
        CountingCallback.steps.append(state.step)


class Recorder:
    def __init__(self):
        self.began = self.ended = None
        self.updates, self.params = [], []

    def on_train_begin(self, state):
        self.began = state.step

    def on_step_end(self, state):
        self.updates.append({k: v.clone() for k, v in state.updates.items()})
        self.params.append({k: v.detach().clone() for k, v in state.model.named_parameters()})

    def on_train_end(self, state):
        self.ended = state.step


def test_callbacks_see_the_released_update_of_each_step(make_cfg):
    from workbench import train

    CountingCallback.steps = []
    recorder = Recorder()
    cfg = make_cfg("experiment=quick", "max_steps=6", "optimizer.momentum=0", "tracking.enabled=false",
                   "callbacks=[{_target_: tests.test_callbacks.CountingCallback}]")
    result = train(cfg, callbacks=[recorder])
    assert CountingCallback.steps == list(range(1, 7)) and (recorder.began, recorder.ended) == (0, 6)
    names = [n for n, p in result.model.named_parameters()]
    assert sorted(recorder.updates[0]) == sorted(names)
    # Plain SGD: each step moves every parameter by -lr x the update the callback saw: the one the optimizer applied.
    lr = cfg.learning_rate
    for before, after, update in zip(recorder.params, recorder.params[1:], recorder.updates[1:]):
        for n in names:
            torch.testing.assert_close(after[n], before[n] - lr * update[n], rtol=1e-5, atol=1e-6)
