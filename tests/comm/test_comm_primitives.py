"""The MPI primitives of document 000 ch. 2, checked against numpy on the full data.

Runs on the pool of 8 Gloo ranks that test_comm_allreduce.py uses, on process groups of
1, 2, 3, 4 and 5 ranks whose group ranks differ from their global ranks. Each rank returns
what it computed; the references are computed here, from the same seeded data.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks

import ddtrain.comm as comm
from ddtrain.errors import DDTrainError

POOL = 8
TIMEOUT_S = 600   # the first call starts 8 processes: minutes on a busy 2-core machine
_groups: dict = {}


def members(world: int) -> list[int]:
    return sorted((5 * i + 2) % POOL for i in range(world))   # 5 is coprime with 8


def group_of(world: int):
    """(group, my group rank or -1); every rank of the pool calls it."""
    if world not in _groups:
        _groups[world] = dist.new_group(members(world))
    group = _groups[world]
    return group, dist.get_rank(group)


def data(seed: int, rank: int, shape, dtype=np.float64) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + rank)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-3 if dtype != np.uint8 else 0, 4, shape).astype(dtype)
    return rng.normal(size=shape).astype(dtype)


# --- document 000's worked examples (4 ranks, 3 numbers each, the numbers 0..11) -------------

def _worked_examples(world: int, per_rank: int, seed: int | None):
    group, me = group_of(world)
    if me < 0:
        return None
    if seed is None:
        full = np.arange(world * per_rank, dtype=np.float64)        # the thesis's [0, 1, ..., 11]
    else:
        full = np.random.default_rng(seed).normal(5, 3, world * per_rank)
    out = {}
    # Mean via Scatter + Gather: root 0 holds everything, scatters chunks, gathers local means.
    chunk = comm.scatter(torch.from_numpy(full) if me == 0 else None, torch.empty(per_rank, dtype=torch.float64),
                         root=0, group=group)
    local_mean = chunk.mean()
    out["local_mean"] = local_mean.item()
    means = comm.gather(local_mean, root=0, group=group)
    out["gathered_means"] = None if means is None else means.tolist()
    out["scatter_gather_mean"] = None if means is None else means.mean().item()
    # Mean via Allgather: every rank gets every local mean.
    out["allgather_mean"] = comm.allgather(local_mean, group=group).mean().item()
    # Sum via Reduce.
    rank_sum = chunk.sum()
    out["rank_sum"] = rank_sum.item()
    total = comm.reduce(rank_sum, "sum", root=0, group=group)
    out["reduce_sum"] = None if total is None else total.item()
    # Standard deviation via Allreduce (000 sums the squared differences with Reduce at the end).
    global_sum = comm.all_reduce(rank_sum.clone(), "ring", "sum", group)
    mean = global_sum / (per_rank * world)
    squared = ((chunk - mean) ** 2).sum()
    out["squared_diff"] = squared.item()
    global_sq = comm.reduce(squared, "sum", root=0, group=group)
    out["stddev"] = None if global_sq is None else torch.sqrt(global_sq / (per_rank * world)).item()
    return out


def test_document_000_worked_examples_give_the_documents_numbers():
    results = [r for r in run_ranks(_worked_examples, POOL, 4, 3, None, timeout_s=TIMEOUT_S) if r is not None]
    root = results[0]
    assert [r["local_mean"] for r in results] == [1.0, 4.0, 7.0, 10.0]
    assert root["gathered_means"] == [1.0, 4.0, 7.0, 10.0]
    assert root["scatter_gather_mean"] == 5.5
    assert all(r["allgather_mean"] == 5.5 for r in results)
    assert [r["rank_sum"] for r in results] == [3.0, 12.0, 21.0, 30.0]
    assert root["reduce_sum"] == 66.0
    assert [r["squared_diff"] for r in results] == [62.75, 8.75, 8.75, 62.75]
    assert round(root["stddev"], 2) == 3.45
    assert root["stddev"] == pytest.approx(np.std(np.arange(12.0)), rel=1e-12)


@pytest.mark.parametrize("world,per_rank", [(2, 5), (3, 4), (5, 1)])
def test_worked_examples_agree_with_numpy_on_random_data(world, per_rank):
    full = np.random.default_rng(11).normal(5, 3, world * per_rank)
    results = [r for r in run_ranks(_worked_examples, POOL, world, per_rank, 11, timeout_s=TIMEOUT_S) if r is not None]
    root = results[0]
    assert root["scatter_gather_mean"] == pytest.approx(full.mean(), rel=1e-12)
    assert all(r["allgather_mean"] == pytest.approx(full.mean(), rel=1e-12) for r in results)
    assert root["reduce_sum"] == pytest.approx(full.sum(), rel=1e-12)
    assert root["stddev"] == pytest.approx(full.std(), rel=1e-12)
    assert all(r["gathered_means"] is None for r in results[1:])


# --- each primitive, any root, several shapes and dtypes ---------------------------------------

SHAPES = [(), (3,), (2, 3)]


def _primitives(world: int, root: int, seed: int):
    group, me = group_of(world)
    if me < 0:
        return None
    out = {}
    for i, shape in enumerate(SHAPES):
        mine = torch.from_numpy(data(seed + i, me, shape))
        t = mine.clone()
        out[f"bcast{i}"] = comm.bcast(t, root, group).numpy()
        stacked = (world,) + shape[1:] if shape == () else (world * shape[0],) + shape[1:]
        send = torch.from_numpy(data(seed + i, 99, stacked)) if me == root else None
        out[f"scatter{i}"] = comm.scatter(send, torch.empty(shape, dtype=torch.float64), root, group).numpy()
        g = comm.gather(mine, root=root, group=group)
        out[f"gather{i}"] = None if g is None else g.numpy()
        out[f"allgather{i}"] = comm.allgather(mine, group=group).numpy()
    a2a = torch.from_numpy(data(seed, me, (world * 2, 3)))
    out["alltoall"] = comm.alltoall(a2a, group=group).numpy()
    # send/recv around the ring, each rank passing its own rank number on
    right, left = (me + 1) % world, (me - 1) % world
    if world > 1:
        box = torch.empty(2, dtype=torch.int64)
        if me % 2 == 0:
            comm.send(torch.tensor([me, 7 * me]), right, group)
            comm.recv(box, left, group)
        else:
            comm.recv(box, left, group)
            comm.send(torch.tensor([me, 7 * me]), right, group)
        out["recv"] = box.tolist()
    return out


@pytest.mark.parametrize("world,root", [(1, 0), (2, 1), (3, 2), (5, 3)])
def test_bcast_scatter_gather_allgather_alltoall_send_recv(world, root):
    seed = 7 * world + root
    results = [r for r in run_ranks(_primitives, POOL, world, root, seed, timeout_s=TIMEOUT_S) if r is not None]
    assert len(results) == world
    for i, shape in enumerate(SHAPES):
        inputs = [data(seed + i, r, shape) for r in range(world)]
        stacked_shape = (world,) + shape[1:] if shape == () else (world * shape[0],) + shape[1:]
        full = data(seed + i, 99, stacked_shape)
        stack = np.stack(inputs).reshape(stacked_shape)
        for r, res in enumerate(results):
            np.testing.assert_array_equal(res[f"bcast{i}"], inputs[root])
            np.testing.assert_array_equal(res[f"scatter{i}"], full.reshape(world, *shape)[r])
            np.testing.assert_array_equal(res[f"allgather{i}"], stack)   # ordered by rank
            if r == root:
                np.testing.assert_array_equal(res[f"gather{i}"], stack)
            else:
                assert res[f"gather{i}"] is None
    sends = [data(seed, r, (world * 2, 3)).reshape(world, 2, 3) for r in range(world)]
    for j, res in enumerate(results):
        expected = np.concatenate([sends[i][j] for i in range(world)])   # block i came from rank i
        np.testing.assert_array_equal(res["alltoall"], expected)
        if world > 1:
            left = (j - 1) % world
            assert res["recv"] == [left, 7 * left]


REDUCE_CASES = [  # (op, numpy dtype)
    ("sum", np.float64), ("sum", np.int64), ("avg", np.float32), ("prod", np.int32), ("prod", np.float64),
    ("max", np.float32), ("min", np.int8), ("land", np.int64), ("lor", np.float64), ("band", np.int32),
    ("bor", np.uint8), ("band", np.bool_), ("maxloc", np.int64), ("minloc", np.int16), ("maxloc", np.float64),
]


def _reduce(world: int, root: int, seed: int):
    group, me = group_of(world)
    if me < 0:
        return None
    out = []
    for i, (op, dtype) in enumerate(REDUCE_CASES):
        mine = torch.from_numpy(data(seed + i, me, (4, 5), dtype))
        before = mine.clone()
        result = comm.reduce(mine, op, root, group)
        if not torch.equal(mine, before):       # report, never assert on a rank (the others would wait)
            result = "input modified"
        elif isinstance(result, tuple):
            result = tuple(t.numpy() for t in result)
        elif result is not None:
            result = result.numpy()
        out.append(result)
    return out


NUMPY_REDUCE = {
    "sum": lambda s: s.sum(0, dtype=s.dtype), "avg": lambda s: s.mean(0, dtype=s.dtype),
    "prod": lambda s: s.prod(0, dtype=s.dtype), "max": lambda s: s.max(0), "min": lambda s: s.min(0),
    "land": lambda s: np.logical_and.reduce(s != 0, 0), "lor": lambda s: np.logical_or.reduce(s != 0, 0),
    "band": lambda s: np.bitwise_and.reduce(s, 0), "bor": lambda s: np.bitwise_or.reduce(s, 0),
    "maxloc": lambda s: (s.max(0), s.argmax(0)), "minloc": lambda s: (s.min(0), s.argmin(0)),
}


@pytest.mark.parametrize("world,root", [(1, 0), (3, 1), (4, 0), (5, 4)])
def test_reduce_every_op_against_numpy(world, root):
    seed = 100 + world
    results = [r for r in run_ranks(_reduce, POOL, world, root, seed, timeout_s=TIMEOUT_S) if r is not None]
    for i, (op, dtype) in enumerate(REDUCE_CASES):
        stack = np.stack([data(seed + i, r, (4, 5), dtype) for r in range(world)])
        expected = NUMPY_REDUCE[op](stack)
        for r, res in enumerate(results):
            got = res[i]
            if r != root:
                assert got is None
            elif op in ("maxloc", "minloc"):   # argmax/argmin give the lowest rank on ties, as MPI does
                np.testing.assert_array_equal(got[0], expected[0])
                np.testing.assert_array_equal(got[1], expected[1])
            elif np.issubdtype(stack.dtype, np.floating) and op in ("sum", "avg", "prod"):
                np.testing.assert_allclose(got, expected, rtol=1e-5 if dtype == np.float32 else 1e-12)
            else:
                np.testing.assert_array_equal(got, expected)
                assert got.dtype == expected.dtype, (op, got.dtype, expected.dtype)


def test_bad_arguments_fail_at_the_boundary():
    with pytest.raises(DDTrainError, match="valid: .*maxloc"):
        comm.reduce(torch.ones(2), "median")
    with pytest.raises(DDTrainError, match="bitwise op 'band' needs an integer or bool dtype"):
        comm.reduce(torch.ones(2), "band")
    with pytest.raises(DDTrainError, match="root 1 is not a rank of a group of 1"):
        comm.bcast(torch.ones(2), root=1)
    with pytest.raises(DDTrainError, match=r"shape \(1, 3\)"):
        comm.scatter(torch.ones(5), torch.empty(1, 3))
    with pytest.raises(DDTrainError, match="one block per rank"):
        comm.gather(torch.ones(2), out=torch.empty(3))
