"""Callbacks: any object with some hook methods is one; it sees a TrainState with attributes, each step's
clock readings once in its logs, and can add to the record before fit writes it; fault injection is a
callback only when DDTRAIN_FAULT asks for one."""
import json

import torch

from ddtrain import Callback, TrainConfig, fit
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.models import build_model
from ddtrain.reliability import faults
from ddtrain.training.callbacks import TrainState, bound


def tiny():
    x, y = torch.randn(64, 1, 4, 4, generator=torch.Generator().manual_seed(1)), torch.arange(64) % 3
    data = Data("synthetic", ArrayDataset(x, y, num_classes=3), None, 3, (1, 4, 4), "classification")
    torch.manual_seed(0)
    return data, build_model("mlp", num_classes=3, in_channels=1, input_size=(4, 4), hidden=(8,))


class Plain:  # no base class: only the hooks it has are called
    def __init__(self):
        self.seen, self.times = [], []

    def on_train_begin(self, state):
        assert isinstance(state, TrainState) and state.step == 0 and state.epoch == 1
        assert state.model is state.strategy.module and state.config.recipe.batch_size == 16

    def on_step_end(self, step, logs, state):
        assert state.step == step and torch.is_tensor(logs["loss"])
        self.times.append((logs["begin_s"], logs["data_end_s"], logs["compute_end_s"], logs["end_s"]))
        self.seen.append((step, state.epoch, state.steps_done))

    def on_train_end(self, record, state):
        record["plain"] = len(self.seen)


def test_a_plain_object_is_a_callback_and_adds_to_the_record_before_it_is_written(tmp_path):
    data, model = tiny()
    out = tmp_path / "run.json"
    cb = Plain()
    record = fit(model, data, TrainConfig.from_flat(model="mlp", data="synthetic", epochs=2, batch_size=16,
                                                    val_fraction=0.0, quiet=True, out=str(out)), callbacks=[cb])
    assert cb.seen == [(1, 1, 1), (2, 1, 2), (3, 1, 3), (4, 1, 4), (5, 2, 1), (6, 2, 2), (7, 2, 3), (8, 2, 4)]
    assert all(a <= b <= c <= d for a, b, c, d in cb.times)
    assert all(cb.times[i][3] == cb.times[i + 1][0] for i in (0, 1, 2, 4, 5, 6))  # a step begins where one ended
    assert record["plain"] == 8 and json.loads(out.read_text())["plain"] == 8


def test_only_the_hooks_a_callback_defines_are_bound():
    class Some(Callback):
        def on_step_end(self, step, logs, state):
            pass
    some, plain = Some(), Plain()
    assert bound([some, plain], "on_step_end") == [some.on_step_end, plain.on_step_end]
    assert bound([some, plain], "on_step_begin") == [] and bound([some, plain], "on_train_begin") == [
        plain.on_train_begin]


def test_fault_injection_is_a_callback_only_when_asked_for():
    saved = faults._fault
    try:
        faults._fault = None
        assert faults.injectors(0) == []
        faults._fault = faults._parse("rank=1,step=3,kind=raise")
        assert faults.injectors(0) == [] and isinstance(faults.injectors(1)[0], faults.FaultInjector)
    finally:
        faults._fault = saved
