"""A compressed run stopped at a checkpoint and resumed equals its uninterrupted twin bit for bit (issue 28, item 4).

``ddtrain train --compression powersgd:2:2`` (and ``topk:0.1``, ``fp16``) on 2 and 3 Gloo ranks:
the run to step 11 against the run stopped at step 5 and resumed from its checkpoint: the final
parameters must be equal, difference exactly 0. The error feedback, PowerSGD's Q, its step
count and seed generator are in the checkpoint (``Strategy.compressor_state_dict``). Without
the restore (the compressor starting afresh, as before) the parameters differ: the same runs
with the restore switched off must show it, or this test could not catch its loss.
The model (1.4 MB of parameters, ``bucket_cap_mb=0.05``) has two DDP buckets after DDP rebuilds them, and
one, every parameter in model order, at a new DDP's first step: the restarted first step is reduced as
the saved buckets (``HookState``), without which 3 ranks differ in the last bits (the sums' order).
"""
import pytest
import torch

from multirank import run_ranks

from ddtrain import TrainConfig, fit
from ddtrain.comm.compression.powersgd import PowerSGD
from ddtrain.comm.compression.topk import TopK
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.models import build_model
from ddtrain.sync.allreduce import AllReduceStrategy
from ddtrain.sync.base import SyncOptions


def data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(480, 1, 32, 32, generator=g), torch.randint(0, 10, (480,), generator=g)
    return Data("synthetic", ArrayDataset(x, y, num_classes=10), None, 10, (1, 32, 32), "classification")


def train_rank(compression, steps, directory=None, resume=False, save=None, restore=True):
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=10, in_channels=1, input_size=(32, 32), hidden=(320, 64))
    options = dict(checkpoint_dir=directory, checkpoint_every=5, resume=resume) if directory else {}
    config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy="ddp", steps=steps, batch_size=16,
                                   lr=0.05, momentum=0.9, seed=3, val_fraction=0.0, quiet=True, save=save, **options)
    config.sync = SyncOptions(compression=compression, bucket_cap_mb=0.05)   # two buckets after DDP rebuilds them
    original = AllReduceStrategy.load_compressor_state_dict
    if not restore:   # the behaviour before issue 28: the compressor starts afresh at a resume
        AllReduceStrategy.load_compressor_state_dict = lambda self, state: None
    try:
        record = fit(model, data(), config)
    finally:
        AllReduceStrategy.load_compressor_state_dict = original
    return record["reliability"]["resumed_from"], record["comm"][0].get("buckets_reduced")


def largest_relative_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


def resumed_difference(tmp_path, compression, world, restore=True) -> float:
    ref, out, directory = tmp_path / "ref.pt", tmp_path / "out.pt", tmp_path / f"ckpt-{restore}"
    if not ref.exists():
        run_ranks(train_rank, world, compression, 11, save=str(ref))
    run_ranks(train_rank, world, compression, 5, str(directory))
    (resumed, buckets), *_ = run_ranks(train_rank, world, compression, 11, str(directory), True, str(out), restore)
    assert resumed["step"] == 5
    load = lambda p: torch.load(p, map_location="cpu", weights_only=True)   # noqa: E731
    return largest_relative_difference(load(out), load(ref))


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("compression", ["topk:0.1", "fp16", "powersgd:2:2"])
def test_a_resumed_compressed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path, compression, world):
    assert resumed_difference(tmp_path, compression, world) == 0.0
    if compression != "fp16":   # fp16 keeps nothing between steps: nothing to lose
        lost = resumed_difference(tmp_path, compression, world, restore=False)
        print(f"{compression} on {world} ranks, resumed at step 5 without the compressor state: "
              f"largest relative difference {lost:.3g}")
        assert lost > 1e-4


def test_compressor_state_does_not_depend_on_the_bucket_layout():
    """Steps 1-3 in two buckets, then one bucket in another order: a compressor restored from a state_dict
    between them gives the same bits as the one that went on (its buckets were rebuilt, as DDP's are)."""
    shapes = {0: (16, 12), 1: (16,), 2: (10, 16), 3: (10,)}
    first = [[0, 1], [2, 3]]
    then = [[3, 2, 1, 0]]

    def grads(step):
        g = torch.Generator().manual_seed(step)
        return {k: torch.randn(s, generator=g) for k, s in shapes.items()}

    def step(compressor, layout, n):
        g, out = grads(n), {}
        for index, keys in enumerate(layout):
            flat = torch.cat([g[k].reshape(-1) for k in keys])
            compressor.all_reduce_(flat, [shapes[k] for k in keys], key=index, keys=keys, last=index == len(layout) - 1)
            out[tuple(keys)] = flat
        return out

    for make in (lambda: PowerSGD(2, 2), lambda: TopK(0.2)):
        going = make()
        for n in range(4):
            step(going, first, n)
        restored = make()
        restored.load_state_dict(going.state_dict(), shapes)
        for n in range(4, 7):
            a, b = step(going, then, n), step(restored, then, n)
            assert all(torch.equal(a[k], b[k]) for k in a), type(going).__name__


def test_a_state_of_another_model_is_refused_naming_the_tensor():
    state = TopK(0.1)
    state.all_reduce_(torch.ones(12), [(3, 4)], key=0, keys=[0])
    with pytest.raises(ValueError, match="tensor 0 has 12 elements"):
        TopK(0.1).load_state_dict(state.state_dict(), {0: (5, 4)})
    with pytest.raises(ValueError, match="names tensor 0, which the model does not have"):
        TopK(0.1).load_state_dict(state.state_dict(), {1: (3, 4)})


def test_the_resize_message_claims_identical_training_only_where_it_is():
    from ddtrain.reliability.checkpoint_elastic import RULES, rule
    from ddtrain.sync import strategy_spec
    ddp = strategy_spec("ddp")
    assert rule(ddp) == "identical" and RULES["identical"].startswith("identical training")
    assert rule(ddp, "fp16") == rule(strategy_spec("ring"), "bf16") == "compressed"
    assert rule(ddp, "powersgd:2") == rule(ddp, "topk:0.1") == "residuals-merged"
    for name in ("compressed", "residuals-merged"):
        assert "not identical training" in RULES[name]


def test_a_resize_gives_every_new_worker_the_old_workers_mean_error_and_keeps_q():
    from ddtrain.reliability import checkpoint
    from ddtrain.reliability.checkpoint_elastic import reshape
    errors = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 6.0, -3.0])]
    q = torch.tensor([0.5, -0.5])
    parts = [{"meter": torch.zeros(3), "rng": checkpoint.rng_state(), "rng_epoch": checkpoint.rng_state(),
              "compressor": {"compression": "powersgd:2", "buckets": [[1, 0]],
                             "state": {"steps": 7, "error": {0: e}, "q": {0: q}}}} for e in errors]
    out = reshape(parts, {"model": {}}, elastic={"workers": 2, "rule": "residuals-merged"}, workers=3, seed=0, step=5,
                  capture=checkpoint.rng_state, apply=checkpoint.set_rng_state)
    assert len(out) == 3
    for _, part in out:
        state = part["compressor"]["state"]
        assert torch.equal(state["error"][0], torch.tensor([2.0, 4.0, 0.0]))   # the mean: the same residual
        assert torch.equal(state["q"][0], q) and state["steps"] == 7           # the same on every rank: kept
        assert part["compressor"]["buckets"] == [[1, 0]]
