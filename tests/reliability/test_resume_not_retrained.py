"""A resumed run trains only the steps after its checkpoint: counted, not taken from its own ``resumed_from``.

Training is deterministic, so a "resume" that silently retrained from step 0 would end with the
same bits as a real one; what tells them apart is which steps run. A callback counts the steps
each run begins and records each step's loss: the resumed run must begin exactly steps 17..29,
with the losses the uninterrupted run had at those steps (the same weights and the same batches).
"""
import os

from ddtrain import Callback
from ddtrain.config import TrainConfig
from ddtrain.training.build import load_and_build
from ddtrain.training.loop import fit

os.environ.pop("RANK", None)  # a world of one, in this process

# 23 steps an epoch (1437 digits, batch 64): the checkpoint at step 17 is mid-epoch 1, the run ends in epoch 2
SETTINGS = dict(model="mlp", data="digits", batch_size=64, lr=0.05, momentum=0.9, seed=3, epochs=2, steps=30,
                quiet=True, model_args={"hidden": (32,), "dropout": 0.2})


class StepLog(Callback):
    def __init__(self):
        self.begun, self.losses = [], {}

    def on_step_begin(self, step, state):
        self.begun.append(step)

    def on_step_end(self, step, logs, state):
        self.losses[step] = logs["loss"].item()   # ``step`` counts the steps done, this one included


def train(**overrides):
    config = TrainConfig.from_flat(**{**SETTINGS, **overrides})
    data, model = load_and_build(config)
    log = StepLog()
    record = fit(model, data, config, callbacks=[log])
    return log, record


def test_a_resumed_run_begins_only_the_steps_after_its_checkpoint(tmp_path):
    whole, _ = train()
    assert whole.begun == list(range(30))
    folder = str(tmp_path / "ckpt")
    first, _ = train(steps=17, checkpoint_dir=folder, checkpoint_every=17)
    assert first.begun == list(range(17))
    resumed, record = train(checkpoint_dir=folder, checkpoint_every=17, resume=True)
    assert record["reliability"]["resumed_from"]["step"] == 17
    assert resumed.begun == list(range(17, 30))          # 13 steps, none of the 17 already trained
    assert sorted(resumed.losses) == list(range(18, 31))
    # the steps it ran are the uninterrupted run's steps: the same weights met the same batches
    assert resumed.losses == {s: whole.losses[s] for s in range(18, 31)}
    assert [e["epoch"] for e in record["epochs"]] == [1, 2]
    assert record["epochs"][0]["steps"] == 23 and record["epochs"][1]["steps"] == 7
