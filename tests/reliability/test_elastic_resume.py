"""Elastic resume: a run checkpointed on R1 workers and resumed on R2 trains on as the uninterrupted R1 run.

With --global-batch-size 96 fixed, 2 workers train 30 steps and checkpoint; from that one
checkpoint 3 workers and 4 workers each train to step 60; their final parameters must equal
(rtol 1e-5) those of 2 workers training 60 steps without a break. The reference is the
uninterrupted run, so a sample order that depended on the world size, a merged state that
lost the optimizer's momentum, or a grad-accum that changed the mean gradient all fail it.
Beyond the parameters: a resize in the middle of an epoch must report that epoch's metrics over
every worker's samples (the checkpoint's per-worker sums added up), and every rank the
checkpoint did not have must get a random stream of its own, seeded from (seed, step, rank).
"""
import os
import shutil

import pytest
import torch

from helpers import assert_one_clear_error, assert_same_parameters, ddtrain
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
            "grad_accum": record["config"]["recipe"]["grad_accum"]}


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


def test_ddp_resumes_on_3_workers_as_the_uninterrupted_2_worker_run(tmp_path):
    run_matrix("ddp", tmp_path, sizes=(3,))


@pytest.mark.slow
@pytest.mark.parametrize("strategy,servers", [("ddp", 0), ("ring", 0), ("tree", 0), ("ps-sync", 1)])
def test_acceptance_2_workers_then_3_and_4_equal_the_uninterrupted_run(strategy, servers, tmp_path):
    """Acceptance 1: --global-batch-size 96, 2 workers to step 30, then 3 and 4 workers to 60 from that checkpoint."""
    run_matrix(strategy, tmp_path, servers=servers, sizes=(3, 4))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring-async", "butterfly", "central"])
def test_the_other_synchronous_strategies_resume_on_3_workers_as_the_uninterrupted_run(strategy, tmp_path):
    run_matrix(strategy, tmp_path, sizes=(3,))


@pytest.mark.slow
def test_a_grad_accum_that_no_longer_divides_is_rechosen_and_training_is_unchanged(tmp_path):
    """--grad-accum 16 on 2 workers (micro-batches of 3); on 4 workers 96 / (4 x 16) is no integer: 24 is chosen."""
    ref = tmp_path / "ref.pt"
    run_ranks(train_rank, 2, "ddp", 40, save=str(ref), grad_accum=16)
    first = tmp_path / "ckpt"
    run_ranks(train_rank, 2, "ddp", 30, str(first), grad_accum=16)
    out = tmp_path / "4.pt"
    ranks = run_ranks(train_rank, 4, "ddp", 40, str(first), True, save=str(out), grad_accum=16)
    assert ranks[0]["grad_accum"] == 24 and ranks[0]["global_batch_size"] == G
    assert_same_parameters(load(ref), load(out), rtol=1e-5)


def train_rank_with_streams(steps, directory, resume=False, every=25):
    """A ddp rank: its epochs' metrics and 4 draws from its torch stream after the run."""
    config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy="ddp", steps=steps, global_batch_size=G,
                                   lr=0.05, momentum=0.9, seed=3, val_fraction=0.0, quiet=True,
                                   **(dict(checkpoint_dir=directory, checkpoint_every=every, resume=resume)
                                      if directory else {}))
    record = fit(elastic_model(), elastic_data(), config)
    return {"epochs": [(e["epoch"], e["steps"], e["train_loss"], e["train_accuracy"]) for e in record["epochs"]],
            "draws": torch.rand(4)}


@pytest.mark.slow
def test_a_resize_mid_epoch_reports_that_epochs_metrics_over_every_worker_and_new_ranks_draw_their_own_streams(
        tmp_path):
    """2 workers stop at step 25 (5 steps into epoch 3 of 10 steps); 4 resume to 30. Epoch 3's loss and accuracy must
    be the uninterrupted 2-worker run's (rank 0 holds both old workers' sums of the first 5 steps), and the ranks'
    streams must all differ (ranks 2 and 3 are new: one stream each, not one shared)."""
    reference = run_ranks(train_rank_with_streams, 2, 30, None)[0]["epochs"]
    run_ranks(train_rank_with_streams, 2, 25, str(tmp_path / "ckpt"))
    resumed = run_ranks(train_rank_with_streams, 4, 30, str(tmp_path / "ckpt"), True)
    (epoch, steps, loss, accuracy), = [e for e in resumed[0]["epochs"] if e[0] == 3]
    assert (epoch, steps) == reference[2][:2] == (3, 10)
    assert loss == pytest.approx(reference[2][2], rel=1e-5) and accuracy == pytest.approx(reference[2][3], rel=1e-9)
    draws = [tuple(r["draws"].tolist()) for r in resumed]
    assert len(set(draws)) == 4, draws


def test_reshape_adds_every_workers_metric_sums_on_rank_0_and_seeds_each_new_rank_from_its_own_rank():
    """``checkpoint_elastic.reshape`` from 2 workers to 4: rank 0 holds the sum of both workers' epoch sums (the
    loop all-reduces them at the epoch's end), the others zeros; ranks 0-1 keep their streams, ranks 2-3 get
    (seed, step, rank)'s, each its own; this process's own RNG is left as it was."""
    from ddtrain.reliability import checkpoint_elastic
    streams = []
    for r in range(2):
        torch.manual_seed(100 + r)
        streams.append(checkpoint.rng_state())
    parts = [{"rng": streams[r], "rng_epoch": streams[r], "meter": torch.tensor([1.5, 2.0, 3.0]) * (10 ** r)}
             for r in range(2)]
    torch.manual_seed(7)
    before = torch.get_rng_state()
    out = checkpoint_elastic.reshape(parts, None, elastic={"workers": 2, "rule": "identical"}, workers=4, seed=3,
                                     step=25, capture=checkpoint.rng_state, apply=checkpoint.set_rng_state)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(out[0][1]["meter"], torch.tensor([16.5, 22.0, 33.0]))
    assert all(torch.equal(part["meter"], torch.zeros(3)) for _, part in out[1:])
    torch_streams = [part["rng"]["torch"] for _, part in out]
    assert torch.equal(torch_streams[0], streams[0]["torch"]) and torch.equal(torch_streams[1], streams[1]["torch"])
    for r in (2, 3):
        expected = checkpoint_elastic.derived_rng(3, 25, r, checkpoint.rng_state, checkpoint.set_rng_state)
        assert torch.equal(torch_streams[r], expected["torch"])
    assert len({bytes(t.numpy()) for t in torch_streams}) == 4


# ---- strategies whose state is per rank: what a resize does ----

@pytest.mark.slow
@pytest.mark.parametrize("strategy,rule", [("local-sgd", "average"), ("hybrid", "rank0")])
def test_a_resize_of_per_rank_state_averages_or_takes_rank_0_at_the_boundary(strategy, rule, tmp_path):
    """local-sgd: the resumed replicas start from the mean of the checkpoint's replicas (an averaging at the boundary);
    hybrid: from rank 0's (its broadcast). Checked against the replicas read from the checkpoint file itself."""
    first = tmp_path / "ckpt"
    run_ranks(train_rank, 2, strategy, 30, str(first), sync_every=4)   # last sync at step 28
    _, payload = checkpoint.read(checkpoint.path_for(first, 30))
    replicas = [part["model"] for part in payload["ranks"]]
    if rule == "average":   # local steps since step 28: the replicas differ (hybrid's ring keeps them equal on CPU)
        assert any(not torch.equal(replicas[0][k], replicas[1][k]) for k in replicas[0])
    expected = {k: (replicas[0][k] + replicas[1][k]) / 2 if rule == "average" else replicas[0][k] for k in replicas[0]}
    out = tmp_path / "3.pt"
    ranks = run_ranks(train_rank, 3, strategy, 30, str(first), True, save=str(out), sync_every=4)  # no step more
    assert ranks[0]["resumed_from"]["workers_was"] == 2
    assert_same_parameters(expected, load(out), rtol=1e-6)


# ---- bad input: one clear message, nothing overwritten ----

def single_run(directory, resume=False, steps=12, **extra):
    os.environ.pop("RANK", None)
    config = TrainConfig.from_flat(model="mlp", data="synthetic", steps=steps, global_batch_size=G, lr=0.05, seed=3,
                                   val_fraction=0.0, quiet=True, checkpoint_dir=str(directory), resume=resume,
                                   **extra)
    return fit(elastic_model(), elastic_data(), config)


@pytest.fixture(scope="module")
def one_worker_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad") / "ckpt"
    single_run(folder)
    return folder


def snapshot(folder):
    """The checkpoint files' bytes (the directory's lock file records who holds it, and may change)."""
    return {p.name: p.read_bytes() for _, p in checkpoint.listing(folder)}


def test_resume_rechooses_grad_accum_or_refuses_naming_the_worker_counts_that_fit():
    config = TrainConfig.from_flat(global_batch_size=96, grad_accum=16, resume=True, checkpoint_dir="unused")
    assert config.resolved(4).recipe.grad_accum == 24 and config.resolved(4).recipe.batch_size == 1
    assert config.resolved(3).recipe.grad_accum == 16 and config.resolved(3).recipe.batch_size == 2   # 96 = 3 x 16 x 2
    assert config.resolved(48).recipe.grad_accum == 2                                   # 48 x 16 > 96: the largest below
    with pytest.raises(DDTrainError, match="worker counts that can: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96"):
        config.resolved(5)
    fresh = TrainConfig.from_flat(global_batch_size=96, grad_accum=16)   # not a resume: refused as before
    with pytest.raises(DDTrainError, match="worker counts that divide it with grad_accum 16: 1, 2, 3, 6"):
        fresh.resolved(4)


@pytest.mark.slow
def test_a_worker_count_that_does_not_divide_the_global_batch_is_refused_naming_those_that_do(one_worker_checkpoint):
    before = snapshot(one_worker_checkpoint)
    result = ddtrain("train", "--model", "mlp", "--data", "digits", "--nproc", "5", "--global-batch-size", "96",
                     "--steps", "20", "--checkpoint-dir", str(one_worker_checkpoint), "--resume", timeout=120)
    assert_one_clear_error(result, "--global-batch-size 96 samples cannot be shared by 5 worker(s)",
                           "worker counts that can: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96")
    assert snapshot(one_worker_checkpoint) == before


@pytest.mark.parametrize("change,named", [
    (dict(data="another-set"), "data='synthetic' vs 'another-set'"),
    (dict(model_args={"hidden": (16,)}), "model_args="),
    (dict(global_batch_size=48), "global_batch_size=96 vs 48"),
])
def test_a_checkpoint_of_another_model_or_data_set_is_refused_naming_the_field(one_worker_checkpoint, change, named):
    before = snapshot(one_worker_checkpoint)
    config = TrainConfig.from_flat(**{**dict(model="mlp", data="synthetic", steps=20, global_batch_size=G, lr=0.05,
                                             seed=3, val_fraction=0.0, quiet=True, resume=True,
                                             checkpoint_dir=str(one_worker_checkpoint)), **change})
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=10, in_channels=1, input_size=(8, 8),
                        hidden=config.model_args.get("hidden", (32, 16)))
    with pytest.raises(DDTrainError, match="does not fit this run: it has .*" + named.replace("(", r"\(")):
        fit(model, elastic_data(), config)
    assert snapshot(one_worker_checkpoint) == before


def test_a_checkpoint_written_without_a_global_batch_resumes_only_at_its_own_size():
    from ddtrain.reliability import checkpoint_elastic
    from ddtrain.reliability.consistency import ConfigMismatch
    config = TrainConfig.from_flat(model="mlp", data="synthetic", batch_size=32)
    theirs = checkpoint_elastic.section(config, workers=2, servers=0, train_samples=N, resize_rule="identical")
    now = {**theirs, "workers": 3}
    fingerprint = {"model": "mlp", "batch_size": 32}
    with pytest.raises(ConfigMismatch, match="was written by 2 workers and resumes only on 2 .this run has 3.: "
                                             "written without --global-batch-size"):
        checkpoint_elastic.check({"elastic": theirs, "fingerprint": fingerprint}, fingerprint, now, "ckpt-1.pt")
    assert checkpoint_elastic.check({"fingerprint": {**fingerprint, "world_size": 3}}, {**fingerprint, "world_size": 3},
                                    now, "old.pt") is False   # an old checkpoint at its own size: as before


def test_a_checkpoint_from_before_elastic_sections_still_resumes_at_its_own_size(tmp_path):
    folder = tmp_path / "ckpt"
    single_run(folder, steps=12)
    path = checkpoint.path_for(folder, 12)
    header, payload = checkpoint.read(path)
    old = {k: v for k, v in header.items() if k not in ("elastic", "format", "payload_bytes", "sha256", "header_sha256")}
    checkpoint.write(path, old, payload)    # the header as earlier versions wrote it
    assert "elastic" not in checkpoint.read_header(path)[0]
    record = single_run(folder, resume=True, steps=14)
    assert record["reliability"]["resumed_from"]["step"] == 12
