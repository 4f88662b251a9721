"""The step split finds time where it was put: a known delay in one part shows up in that part.

The split's parts add up to the step by construction, which proves nothing about where the time
went. Here each run hides a known sleep in one place -- the data loader's batch, the loss
(forward), the optimizer step, or, on 2 ranks, one rank's forward so that its peer waits in the
gradient all-reduce -- and both the loop's own per-epoch split and the profiler's per-step split
must put (nearly) all of that sleep in that part and little of it anywhere else.
"""
import os
import time

import pytest
import torch
import torch.nn.functional as F

from ddtrain import TrainConfig, fit
from ddtrain.data.arrays import ArrayDataset
from ddtrain.observe.profiler import Profiler
from helpers import tiny_data, tiny_model
from multirank import run_ranks

os.environ.pop("RANK", None)
SLEEP_S, BATCH = 0.04, 16           # 96 samples: 6 steps an epoch in one process, 3 on 2 ranks


class SlowBatches(ArrayDataset):
    def batch(self, idx):
        time.sleep(SLEEP_S)
        return super().batch(idx)


def slow_loss(out, y):
    time.sleep(SLEEP_S)
    return F.cross_entropy(out, y)


class SlowSGD(torch.optim.SGD):
    def step(self, closure=None):
        time.sleep(SLEEP_S)
        return super().step(closure)


def run(where: str, epochs: int = 2):
    """(the loop's step split in seconds per step, the profiler's, steps) of a run slowed at ``where``."""
    model, shape = tiny_model("mlp")
    data = tiny_data(shape)
    if where == "data":
        data.train = SlowBatches(data.train.x, data.train.y, num_classes=10)
    config = TrainConfig.from_flat(model="mlp", data="synthetic", epochs=epochs, batch_size=BATCH, lr=0.1,
                                   seed=3, val_fraction=0.0, quiet=True)
    profiler = Profiler(warmup_steps=1)
    optimizer = SlowSGD(model.parameters(), lr=0.1) if where == "optimizer" else None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    loss_fn = slow_loss if where == "loss" or (where == "loss on rank 1" and rank == 1) else None
    record = fit(model, data, config, optimizer=optimizer, loss_fn=loss_fn, callbacks=[profiler])
    steps = sum(e["steps"] for e in record["epochs"])
    loop = {k: sum(e["step_split_s"][k] for e in record["epochs"]) / steps for k in ("data_s", "compute_s",
                                                                                    "optimizer_s")}
    profile = {r["rank"]: r["split_s"] for r in record["profile"]["ranks"]} if "profile" in record else None
    return loop, profile, steps


@pytest.mark.parametrize("where,part", [("data", "data_s"), ("loss", "compute_s"), ("optimizer", "optimizer_s")])
def test_a_known_delay_lands_in_its_part(where, part, one_thread):
    # one thread: with torch's default two on cores other jobs share, a tiny forward can take 100 ms of spinning
    loop, profile, steps = run(where)
    assert steps == 12
    split = profile[0]
    assert loop[part] >= SLEEP_S and split[part] >= SLEEP_S, (loop, split)
    for other in ("data_s", "compute_s", "optimizer_s", "comm_wait_s"):
        if other != part:   # the other parts of a tiny MLP step take milliseconds, not the sleep
            assert split[other] < SLEEP_S / 2, (other, split)
            assert loop.get(other, 0.0) < SLEEP_S / 2, (other, loop)


def rank_1_slow():
    return run("loss on rank 1", epochs=1)


def test_a_slow_peer_shows_as_communication_wait_on_the_fast_rank():
    loop, profile, steps = run_ranks(rank_1_slow, 2)[0]
    fast, slow = profile[0], profile[1]
    assert slow["compute_s"] >= SLEEP_S and slow["comm_wait_s"] < SLEEP_S / 2, slow
    assert fast["comm_wait_s"] >= 0.75 * SLEEP_S, fast   # rank 0 waits in the all-reduce for rank 1's forward
    assert fast["compute_s"] - fast["comm_wait_s"] < SLEEP_S / 2 and fast["data_s"] < SLEEP_S / 2, fast
