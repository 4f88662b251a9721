"""A strategy's own state between steps survives a resume: local-sgd's schedule and DiLoCo's outer optimizer, hybrid's schedule.

A 2-worker run checkpointed at step 5 and resumed to step 11 must end with the parameters of
the uninterrupted 11-step run, bit for bit. With the schedule counted from the restart (as
before), local-sgd with --sync-every 3 would average at steps 8 and 11 instead of 6 and 9, and
DiLoCo would lose its outer momentum and measure the next outer gradient from the loaded
replica instead of the global parameters: both give other parameters. The record counts the
syncs of the whole run (steps are counted from the start of training too). A local-sgd
checkpoint written exactly at the last warm-up step (5 of 5) must resume into local steps: a
resume that took it for one still inside the warm-up would average the gradients of every
later step.
"""
import pytest
import torch

from helpers import assert_same_parameters
from multirank import run_ranks

from ddtrain import TrainConfig, fit
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.models import build_model
from ddtrain.sync.base import SyncOptions


def data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(400, 1, 8, 8, generator=g), torch.randint(0, 10, (400,), generator=g)
    return Data("synthetic", ArrayDataset(x, y, num_classes=10), None, 10, (1, 8, 8), "classification")


def train_rank(strategy, steps, sync, directory=None, resume=False, save=None):
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=10, in_channels=1, input_size=(8, 8), hidden=(16,))
    options = dict(checkpoint_dir=directory, checkpoint_every=5, resume=resume) if directory else {}
    config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy=strategy, steps=steps, batch_size=16,
                                   lr=0.05, momentum=0.9, seed=3, val_fraction=0.0, quiet=True, save=save, **options)
    config.sync = SyncOptions(**sync)
    record = fit(model, data(), config)
    syncs = record["comm"][0].get("averagings", record["comm"][0].get("broadcasts"))
    return record["reliability"]["resumed_from"], syncs


@pytest.mark.parametrize("strategy, sync", [
    ("local-sgd", {"sync_every": 3, "outer_optimizer": "nesterov", "local_sgd_warmup_steps": 2}),
    ("hybrid", {"sync_every": 4}),
    ("local-sgd", {"sync_every": 3, "local_sgd_warmup_steps": 5}),    # checkpointed at step 5: the warm-up's end
], ids=["local-sgd-diloco", "hybrid", "local-sgd-checkpoint-at-warmup-end"])
def test_a_resumed_run_keeps_the_strategys_schedule_and_outer_state(tmp_path, strategy, sync):
    ref, out, directory = tmp_path / "ref.pt", tmp_path / "out.pt", tmp_path / "ckpt"
    (_, syncs), = run_ranks(train_rank, 2, strategy, 11, sync, save=str(ref))[:1]
    run_ranks(train_rank, 2, strategy, 5, sync, str(directory))
    (resumed, syncs_resumed), = run_ranks(train_rank, 2, strategy, 11, sync, str(directory), True, save=str(out))[:1]
    assert resumed["step"] == 5
    # hybrid's ring keeps the replicas identical, so its broadcasts change no bits: the count shows
    # the schedule went on (broadcasts at steps 4 and 8, not at 4 and 9 of a count restarted at 5)
    assert syncs_resumed == syncs, (syncs_resumed, syncs)
    load = lambda p: torch.load(p, map_location="cpu", weights_only=True)   # noqa: E731
    assert_same_parameters(load(ref), load(out), rtol=0)
