import pytest
import torch
import torch.distributed as dist

from multirank import RankError, run_ranks


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom")
    return dist.get_rank()


def test_every_rank_runs_and_reduces():
    assert run_ranks(_sum_of_ranks, 3) == [3.0, 3.0, 3.0]


def test_a_failing_rank_is_reported_and_the_pool_recovers():
    with pytest.raises(RankError, match="boom"):
        run_ranks(_fail_on_rank_one, 2)
    assert run_ranks(_sum_of_ranks, 2) == [1.0, 1.0]
