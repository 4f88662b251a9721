"""The sample order of a --global-batch-size run is a function of (seed, epoch, step) only, never of the world size."""
import pytest
import torch

from ddtrain.data.sharding import ShardSampler
from ddtrain.errors import DDTrainError


def step_batches(n, G, R, K, epoch, seed=7):
    """{step: sorted sample indices of that step over every rank and micro-batch}, as ShardLoader cuts them."""
    B = G // (R * K)
    out = {}
    for r in range(R):
        sampler = ShardSampler(n, rank=r, world_size=R, seed=seed, global_batch=G)
        sampler.set_epoch(epoch)
        idx = sampler.indices()
        assert len(idx) == len(sampler) and len(sampler) % (B * K) == 0
        for micro in range(len(idx) // B):
            out.setdefault(micro // K, []).extend(idx[micro * B:(micro + 1) * B].tolist())
    return {s: sorted(v) for s, v in out.items()}


@pytest.mark.parametrize("R,K", [(1, 1), (2, 1), (3, 1), (4, 2), (6, 4), (2, 3)])
def test_step_s_trains_perm_s_G_to_s_plus_1_G_whatever_R_and_K(R, K):
    n, G, epoch, seed = 1000, 96, 3, 7
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))   # the documented permutation
    steps = step_batches(n, G, R, K, epoch, seed)
    assert sorted(steps) == list(range(n // G))       # 10 whole global batches; the 40 left over are dropped
    for s, got in steps.items():
        assert got == sorted(perm[s * G:(s + 1) * G].tolist()), (R, K, s)


def test_where_the_global_batches_divide_the_data_the_order_is_todays_bit_for_bit():
    for R in (1, 2, 3, 4):
        for r in range(R):
            old = ShardSampler(960, rank=r, world_size=R, seed=5)
            new = ShardSampler(960, rank=r, world_size=R, seed=5, global_batch=96)
            old.set_epoch(2), new.set_epoch(2)
            assert torch.equal(old.indices(), new.indices()) and len(old) == len(new)


def test_left_over_samples_are_dropped_per_global_batch_not_per_rank():
    sampler = ShardSampler(1000, rank=0, world_size=3, seed=1, global_batch=96)
    assert len(sampler) == 10 * 32   # 960 of 1000 samples, not 1000 // 3 = 333
    assert "dropped 40 samples per epoch" in sampler.describe()["remainder"]


def test_a_global_batch_the_ranks_cannot_share_or_larger_than_the_data_is_refused():
    with pytest.raises(DDTrainError, match="a global batch of 96 samples does not divide among 5 ranks"):
        ShardSampler(1000, rank=0, world_size=5, global_batch=96)
    with pytest.raises(DDTrainError, match="a global batch of 96 samples is more than the 50 training samples"):
        ShardSampler(50, rank=0, world_size=2, global_batch=96)
