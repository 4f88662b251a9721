"""--compression through the strategies: the same update as PyTorch's own DDP hooks, and the bytes the formulas say.

The independent references are torch.distributed.algorithms.ddp_comm_hooks: ``fp16_compress_hook``,
``bf16_compress_hook`` and ``powerSGD_hook`` with ``PowerSGDState`` (rank 2, where torch
orthogonalises by Gram-Schmidt as the paper does; the same seed). On two ranks a sum of two
numbers is the same whichever rank adds, so our ring (and ``ddp``'s hook over the native
all-reduce) must reach torch's parameters bit for bit after several steps, warm-up included.
The bytes: fp16/bf16 record exactly half of the uncompressed run's counters; PowerSGD and top-k
record exactly their ``wire_bytes`` formula for the model's shapes and the world size.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ddtrain.comm import compression
from ddtrain.errors import ConfigError
from ddtrain.sync import SyncOptions, check_options, wrap
from multirank import run_ranks

STEPS = 5
WARMUP = 2


def _model():
    torch.manual_seed(0)
    # 32x16 is compressed at rank 2 ((32+16)·2·2 < 512); 4x32 and the biases are not
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


SHAPES = [tuple(p.shape) for p in _model().parameters()]
N = sum(p.numel() for p in _model().parameters())


def _batches():
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(STEPS)]


def _train(model, optimizer, step=None):
    for x, y in _batches():
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step is not None:
            step()


def torch_hook_parameters(method: str) -> list:
    """Parameters after STEPS steps of DDP with torch's own compression hook."""
    model = _model()
    ddp = DistributedDataParallel(model)
    if method == "powersgd:2:2":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=WARMUP, min_compression_rate=2, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[method]
        # wrapped: DDP refuses torch's bf16 hook itself off CUDA/NCCL by its identity, the arithmetic runs on Gloo
        ddp.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
    _train(ddp, torch.optim.SGD(model.parameters(), lr=0.1))
    return [p.detach().clone() for p in model.parameters()]


def ours(strategy: str, method: str) -> tuple[list, dict]:
    """Parameters after STEPS steps of ``strategy`` with ``--compression method``, and the recorded stats."""
    model = _model()
    synced = wrap(strategy, model, torch.optim.SGD(model.parameters(), lr=0.1), SyncOptions(compression=method))
    steps = iter(range(STEPS))
    _train(synced.model, synced.optimizer, lambda: synced.after_step(next(steps)))
    synced.update_stats()
    stats = synced.stats.as_dict()
    synced.finish()
    return [p.detach().clone() for p in model.parameters()], stats


def equivalence_on_rank():
    out = {}
    for method in ("fp16", "bf16", "powersgd:2:2"):
        reference = torch_hook_parameters(method)
        for strategy in ("ring", "ddp"):
            params, stats = ours(strategy, method)
            out[strategy, method] = (all(torch.equal(a, b) for a, b in zip(reference, params)),
                                     max((a - b).abs().max().item() for a, b in zip(reference, params)),
                                     stats["bytes_sent"])
    out["ddp", "none"] = (True, 0.0, ours("ddp", "none")[1]["bytes_sent"])
    return out


def test_fp16_bf16_powersgd_reach_torchs_hooks_bit_for_bit_on_ring_and_ddp():
    for rank_result in run_ranks(equivalence_on_rank, 2):
        for (strategy, method), (equal, worst, _) in rank_result.items():
            assert equal, f"{strategy} --compression {method}: parameters differ from torch's hook by up to {worst:g}"
        # ddp uncompressed records its formula; the hook over the native all-reduce records half of it
        assert rank_result["ddp", "fp16"][2] * 2 == rank_result["ddp", "none"][2]
        assert rank_result["ddp", "bf16"][2] * 2 == rank_result["ddp", "none"][2]


def traffic_on_rank():
    runs = {method: ours("ring", method) for method in ("none", "fp16", "bf16", "powersgd:4:2", "topk:0.1")}
    out = {method: stats["bytes_sent"] for method, (_, stats) in runs.items()}
    out["ring parameters"] = runs["powersgd:4:2"][0]
    for algorithm in ("ring-async", "tree", "butterfly", "central"):   # the same hook over every algorithm
        out[algorithm] = {method: ours(algorithm, method) for method in ("none", "powersgd:4:2")}
    return out


def test_recorded_bytes_halve_exactly_and_match_the_formulas_on_three_ranks():
    world = 3
    ranks = run_ranks(traffic_on_rank, world)
    for algorithm in ("ring-async", "tree", "butterfly", "central"):
        runs = [r.pop(algorithm) for r in ranks]
        # per rank the algorithms differ (central's rank 0 sends ·N); over the ranks all send 2(R-1)·N
        for method in ("none", "powersgd:4:2"):
            assert sum(run[method][1]["bytes_sent"] for run in runs) == sum(r[method] for r in ranks), (algorithm, method)
        for rank, run in zip(ranks, runs):   # the same update as over the ring, up to the order of the sums
            for got, want in zip(run["powersgd:4:2"][0], rank["ring parameters"]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for r in ranks:
        r.pop("ring parameters")
    for sent in ranks:      # every rank's ring chunks have the same element counts: exactly half, rank by rank
        assert sent["fp16"] * 2 == sent["none"] and sent["bf16"] * 2 == sent["none"]
    total = {method: sum(r[method] for r in ranks) for method in ranks[0]}
    per_step = {m: compression.wire_bytes(m, SHAPES, world) for m in total}   # mean per rank
    assert total["none"] == pytest.approx(world * STEPS * per_step["none"], abs=1e-6)
    assert per_step["none"] == 2 * (world - 1) / world * N * 4
    # PowerSGD: WARMUP uncompressed steps, then the factors' formula
    assert total["powersgd:4:2"] == pytest.approx(world * (WARMUP * per_step["none"] + (STEPS - WARMUP) *
                                                           per_step["powersgd:4:2"]), abs=1e-6)
    assert per_step["powersgd:4:2"] < per_step["none"]
    for sent in ranks:      # the ring all-gather: the same bytes from every rank
        assert sent["topk:0.1"] == STEPS * per_step["topk:0.1"]


def test_bad_specs_and_strategies_without_gradients_are_refused_naming_the_field():
    for spec, phrase in (("zip", "must be one of"), ("powersgd:0", "rank must be a positive"),
                         ("topk:1.5", "fraction must be in (0, 1]"), ("fp16:2", "takes no argument")):
        with pytest.raises(ConfigError, match="compression") as error:
            SyncOptions(compression=spec)
        assert phrase in str(error.value), (spec, str(error.value))
    from ddtrain.config import TrainConfig
    with pytest.raises(ConfigError) as error:
        TrainConfig.from_flat(compression="topk:1.5")
    assert error.value.field == "compression"
    for strategy in ("local-sgd", "hybrid"):
        with pytest.raises(ConfigError, match=f"compression is read only by ddp, .*ps-async, not by strategy '{strategy}'"):
            check_options(strategy, SyncOptions(compression="fp16"))

