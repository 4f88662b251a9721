"""Traffic accounting: every algorithm's counted bytes and messages equal its formula, per rank.

Runs on the pool of 8 Gloo ranks shared with the other test_comm_* files, on process groups
of several sizes. The formulas here are derived from each algorithm's message pattern (see
docs/ALGORITHMS.md), not read back from the implementation.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks

import ddtrain.comm as comm
from ddtrain.comm import ring_async, traffic

POOL = 8
TIMEOUT_S = 600   # the first call starts 8 processes: minutes on a busy 2-core machine
_groups: dict = {}


def group_of(world: int):
    if world not in _groups:
        _groups[world] = None if world == POOL else dist.new_group(sorted((3 * i + 5) % POOL for i in range(world)))
    group = _groups[world]
    return group, (dist.get_rank(group) if group is not None else dist.get_rank())


def _measure_all(world: int, numel: int, dtype_name: str):
    group, me = group_of(world)
    if me < 0:
        return None
    ring_async.SEGMENT_BYTES = 256 * 1024
    out = {}
    for algorithm in comm.ALGORITHMS:
        t = torch.ones(numel, dtype=getattr(torch, dtype_name))
        with traffic.measure() as m:
            comm.all_reduce(t, algorithm, "sum", group)
        out[algorithm] = m.as_dict()
    return out


def ring_sent(r: int, R: int, N: int) -> int:
    """Elements rank r sends in a ring: every chunk but r+1 (reduce-scatter) and but r+2 (all-gather)."""
    size = [N // R + (1 if c < N % R else 0) for c in range(R)]
    return 2 * N - size[(r + 1) % R] - size[(r + 2) % R]


def tree_children(r: int, R: int) -> int:
    lowbit = r & -r if r else 1 << max(0, (R - 1).bit_length())
    return sum(1 for k in range(R.bit_length()) if (1 << k) < lowbit and r + (1 << k) < R)


@pytest.mark.parametrize("world,numel,dtype_name", [(2, 10, "float32"), (3, 12, "float64"), (4, 1003, "float32"),
                                                    (5, 7, "int64"), (8, 4096, "float16"), (6, 600, "float32")])
def test_counted_bytes_equal_each_algorithms_formula(world, numel, dtype_name):
    results = run_ranks(_measure_all, POOL, world, numel, dtype_name, timeout_s=TIMEOUT_S)
    results = [r for r in results if r is not None]
    assert len(results) == world
    es = torch.tensor([], dtype=getattr(torch, dtype_name)).element_size()
    R, N = world, numel
    p2 = 1 << (R.bit_length() - 1)
    extra = R - p2
    for r, res in enumerate(results):
        ring = res["ring"]
        # ring: 2(R-1)/R of the buffer, give or take the two chunks a rank does not send
        assert ring["bytes_sent"] == ring_sent(r, R, N) * es
        assert abs(ring["bytes_sent"] - 2 * (R - 1) / R * N * es) < 2 * es
        if N % R == 0:
            assert ring["bytes_sent"] == 2 * (R - 1) * N // R * es == ring["bytes_received"]
        assert ring["messages_sent"] == ring["messages_received"] == 2 * (R - 1)
        assert ring["method"] == "counted"
        # ring-async: the same bytes; one message per segment (one segment at these sizes)
        assert res["ring-async"]["bytes_sent"] == ring["bytes_sent"]
        assert res["ring-async"]["bytes_received"] == ring["bytes_received"]
        # tree: the partial to the parent and the result from it, N to and from each child
        hops = tree_children(r, R) + (1 if r else 0)
        assert res["tree"]["bytes_sent"] == res["tree"]["bytes_received"] == hops * N * es
        assert res["tree"]["messages_sent"] == hops
        if r == 0:
            assert hops == math.ceil(math.log2(R))
        # central: the master moves (R-1)N each way, everyone else N
        expected = (R - 1) * N * es if r == 0 else N * es
        assert res["central"]["bytes_sent"] == res["central"]["bytes_received"] == expected
        # butterfly: 2(p-1)/p·N inside the power-of-two core, plus N each way for folded pairs
        if N % p2 == 0:
            core = 2 * (p2 - 1) * N // p2 * es
            if r < 2 * extra and r % 2 == 0:
                assert res["butterfly"]["bytes_sent"] == res["butterfly"]["bytes_received"] == N * es
            else:
                folded = N * es if r < 2 * extra else 0
                assert res["butterfly"]["bytes_sent"] == res["butterfly"]["bytes_received"] == core + folded
        # native: reported by formula, and says so
        assert res["native"]["method"] == "formula"
        assert res["native"]["bytes_sent"] == 2 * ((R - 1) * N // R) * es
    for algorithm in ("ring", "ring-async", "tree", "butterfly", "central"):   # every byte sent is received
        assert sum(r[algorithm]["bytes_sent"] for r in results) == sum(r[algorithm]["bytes_received"] for r in results)
        assert sum(r[algorithm]["messages_sent"] for r in results) == \
            sum(r[algorithm]["messages_received"] for r in results)


def _regions_and_hooks():
    group, me = group_of(3)
    if me < 0:
        return None
    traffic.reset()
    spans = []
    comm.all_reduce(torch.ones(9), "tree", "sum", group)
    traffic.add_hook(spans.append)
    with traffic.measure() as region:
        comm.all_reduce(torch.ones(9), "ring", "sum", group)
        comm.allgather(torch.ones(2), group=group)
    traffic.remove_hook(spans.append)
    comm.all_reduce(torch.ones(9), "native", "sum", group)
    total = traffic.snapshot().as_dict()
    everyone = traffic.all_ranks(group)
    traffic.reset()
    return {"region": region.as_dict(), "total": total, "spans": [tuple(s) for s in spans],
            "everyone": everyone, "after_reset": traffic.snapshot().as_dict(), "me": me,
            "ranks": dist.get_process_group_ranks(group)}


def test_snapshot_measure_reset_hooks_and_all_ranks():
    results = [r for r in run_ranks(_regions_and_hooks, POOL, timeout_s=TIMEOUT_S) if r is not None]
    assert len(results) == 3
    for res in results:
        region, total = res["region"], res["total"]
        # the region saw the ring (3 elements x 4 bytes per message, 4 messages each way) and
        # the allgather (2 messages of 2 floats each way), nothing before or after it
        assert set(region["by_operation"]) == {"ring", "allgather"}
        assert region["by_operation"]["ring"]["bytes_sent"] == 4 * 3 * 4
        assert region["by_operation"]["allgather"]["bytes_sent"] == 2 * 2 * 4
        assert region["messages_sent"] == region["messages_received"] == 6
        assert region["method"] == "counted"
        assert set(total["by_operation"]) == {"tree", "ring", "allgather", "native"}
        assert total["method"] == "counted+formula"
        assert total["bytes_sent"] == sum(c["bytes_sent"] for c in total["by_operation"].values())
        assert [e["bytes_sent"] for e in res["everyone"]] == [r["total"]["bytes_sent"] for r in results]
        assert res["after_reset"]["bytes_sent"] == 0 and res["after_reset"]["by_operation"] == {}
        # one span per message while the hook was registered, naming the step and the global peer
        spans = res["spans"]
        assert len(spans) == 12
        me, ranks = res["me"], res["ranks"]
        right, left = ranks[(me + 1) % 3], ranks[(me - 1) % 3]
        assert ("ring reduce-scatter step 0", right, 12, "send") in [(s[0], s[3], s[4], s[5]) for s in spans]
        assert ("ring all-gather step 1", left, 12, "recv") in [(s[0], s[3], s[4], s[5]) for s in spans]
        assert all(s[1] <= s[2] for s in spans)
