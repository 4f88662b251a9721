"""Fetching the optimizer state from two parameter servers that answer two workers in opposite orders: no deadlock.

``optimizer.state_dict()`` on a ps worker sends STATE to every server; each server answers one
worker at a time with a header and then the state's bytes, and a Gloo send waits until its
receiver has posted the receive. The servers may answer their workers in any order (ps-sync
takes them as they arrive), so the worker must take each server's bytes right after that
server's header (969b02f). Before, it first waited for every header: with server A answering
worker 0 first and server B worker 1 first, worker 0 waited for B's header while A waited for
worker 0 to take its bytes, and worker 1 the other way round -- a deadlock seen in about one
run in four of the 4-rank equivalence test, when the arrival order happened to be that one.

Here the servers are driven by this test and answer in exactly that order (A: workers 0, 1;
B: workers 1, 0), so the interleaving that deadlocked is forced on every run instead of hoped
for. Every wait has a 10 s deadline (the workers' 12 s; the exchange itself takes milliseconds):
the old ordering ends in a timeout, reported as a deadlock, never a hung test.
"""
import pytest
import torch
import torch.distributed as dist

from multirank import RankError, run_ranks

from ddtrain.comm.p2p import wait
from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import SyncStats
from ddtrain.sync.ps.protocol import CONTROL_SUFFIX, STATE, FailureNote, make_plan
from ddtrain.sync.ps.server import ServerCore
from ddtrain.sync.ps.worker import WorkerLink

WORLD, SERVERS, DEADLINE_S = 4, 2, 10.0


def model_and_optimizer():
    """The same model on every rank, and SGD with momentum after one step (momentum buffers: state to send)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return model, optimizer


def fetch_state_in_forced_order():
    """Rank 0-1: worker, ``state()``; rank 2 (server A) answers workers 0 then 1, rank 3 (server B) 1 then 0."""
    model, optimizer = model_and_optimizer()
    plan = make_plan("ps-sync", model, SERVERS, DEADLINE_S, WORLD, optimizer)
    rank = dist.get_rank()
    ledger, note = Ledger(plan.operations()), FailureNote("ps-state-order")
    expected = {i: s["momentum_buffer"] for i, s in optimizer.state_dict()["state"].items()}
    if rank in plan.workers:
        got = WorkerLink(plan, ledger, note, optimizer).state()
        return {"role": "worker", "keys": sorted(got),
                "equal": all(torch.equal(got[i]["momentum_buffer"], expected[i]) for i in expected)}
    index = plan.servers.index(rank)
    core = ServerCore(plan, optimizer, index, ledger, SyncStats(), note)
    comm = plan.comm(suffix=CONTROL_SUFFIX)
    requests = {w: core.post_receive(comm, w, "state request") for w in plan.workers}
    for w in plan.workers:       # both requests are in before either is answered
        wait(requests[w].comm, requests[w])
        assert core.inbox[w].read_header()[0] == STATE
    order = plan.workers if index == 0 else plan.workers[::-1]
    for w in order:
        core.aside(comm, w, STATE)
    return {"role": "server", "order": order}


def test_two_workers_fetch_the_state_from_two_servers_answering_in_opposite_orders():
    try:
        ranks = run_ranks(fetch_state_in_forced_order, WORLD, timeout_s=60)
    except RankError as exc:
        pytest.fail(f"deadlock: the workers and servers waited on each other until the {DEADLINE_S:g} s deadline "
                    f"(server A answering worker 0 first, server B worker 1 first):\n{exc}")
    assert [r["role"] for r in ranks] == ["worker", "worker", "server", "server"]
    assert ranks[2]["order"] == [0, 1] and ranks[3]["order"] == [1, 0]
    for worker in ranks[:2]:
        assert worker["keys"] == [0, 1, 2, 3] and worker["equal"], worker
