"""Elastic resume: a run checkpointed on R1 workers and resumed on R2 trains on as the uninterrupted R1 run.

With --global-batch-size 96 fixed, 2 workers train 30 steps and checkpoint; from that one
checkpoint 3 workers and 4 workers each train to step 60; their final parameters must equal
(rtol 1e-5) those of 2 workers training 60 steps without a break. The reference is the
uninterrupted run, so a sample order that depended on the world size, a merged state that
lost the optimizer's momentum, or a grad-accum that changed the mean gradient all fail it.
"""
import os
import shutil

import pytest
import torch

from helpers import assert_same_parameters
from multirank import run_ranks

from ddtrain import TrainConfig, fit
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.errors import DDTrainError
from ddtrain.models import build_model
from ddtrain.reliability import checkpoint

N = 1000   # 10 whole global batches of 96 an epoch, 40 samples dropped: 60 steps cross 5 epoch ends
G = 96


def elastic_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (N,), generator=g)
    return Data("synthetic", ArrayDataset(x, y, num_classes=10), None, 10, (1, 8, 8), "classification")


def elastic_model():
    torch.manual_seed(0)
    return build_model("mlp", num_classes=10, in_channels=1, input_size=(8, 8), hidden=(32, 16))


def train_rank(strategy, steps, directory=None, resume=False, save=None, **extra):
    """One rank's part of a run; the loop writes ``save`` from rank 0 (the --save file)."""
    options = dict(checkpoint_dir=directory, checkpoint_every=30, resume=resume) if directory else {}
    config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy=strategy, steps=steps,
                                   global_batch_size=G, lr=0.05, momentum=0.9, seed=3, val_fraction=0.0,
                                   quiet=True, save=save, **options, **extra)
    record = fit(elastic_model(), elastic_data(), config)
    return {"resumed_from": record["reliability"]["resumed_from"], "global_batch_size": record["global_batch_size"],
            "grad_accum": record["config"]["grad_accum"]}


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def run_matrix(strategy, tmp_path, servers=0, sizes=(3, 4)):
    """Reference (2 workers, 60 steps), 2 workers to 30 with a checkpoint, then each size in ``sizes`` to 60."""
    extra = {"servers": servers} if servers else {}
    ref = tmp_path / f"{strategy}-ref.pt"
    run_ranks(train_rank, 2 + servers, strategy, 60, save=str(ref), **extra)
    first = tmp_path / f"{strategy}-ckpt"
    run_ranks(train_rank, 2 + servers, strategy, 30, str(first), **extra)
    assert [p.name for _, p in checkpoint.listing(first)] == ["ckpt-00000030.pt"]
    results = {}
    for workers in sizes:
        directory = tmp_path / f"{strategy}-ckpt-{workers}"
        shutil.copytree(first, directory)  # the same checkpoint for each size
        out = tmp_path / f"{strategy}-{workers}.pt"
        ranks = run_ranks(train_rank, workers + servers, strategy, 60, str(directory), True, save=str(out), **extra)
        assert ranks[0]["resumed_from"]["step"] == 30 and ranks[0]["resumed_from"]["workers_was"] == 2
        assert ranks[0]["global_batch_size"] == G
        assert_same_parameters(load(ref), load(out), rtol=1e-5)
        results[workers] = ranks[0]
    return results


def test_ddp_resumes_on_3_and_4_workers_as_the_uninterrupted_2_worker_run(tmp_path):
    run_matrix("ddp", tmp_path)


def test_ps_sync_resumes_on_3_workers_with_the_servers_state(tmp_path):
    run_matrix("ps-sync", tmp_path, servers=1, sizes=(3,))
