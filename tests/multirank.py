"""Run a function on R Gloo ranks on 127.0.0.1 and collect every rank's result.

Pools of ranks are kept between calls (spawning R Python processes that import torch costs
seconds each on two cores), keyed by world size, at most ``MAX_POOLS`` alive. A pool whose
call failed or timed out is thrown away, so a broken process group never leaks into the
next test. The function must be importable by module and name (a module-level test helper).
"""
from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from collections import OrderedDict

MAX_POOLS = 3
DEFAULT_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, sys_path, inbox, outbox, pg_timeout_s):
    sys.path[:] = sys_path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    while True:
        job = inbox.get()
        if job is None:
            break
        module, name, args, kwargs = job
        try:
            fn = getattr(importlib.import_module(module), name)
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException as exc:  # report, the parent decides
            outbox.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class Pool:
    def __init__(self, world: int, pg_timeout_s: float = 60.0):
        ctx = mp.get_context("spawn")
        self.world = world
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world, port, list(sys.path), self.inboxes[r], self.outbox, pg_timeout_s))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def call(self, fn, args, kwargs, timeout_s):
        for box in self.inboxes:
            box.put((fn.__module__, fn.__name__, args, kwargs))
        results, errors = [None] * self.world, {}
        for _ in range(self.world):
            try:
                rank, ok, value = self.outbox.get(timeout=timeout_s)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise TimeoutError(f"{fn.__name__} on {self.world} ranks: no answer within {timeout_s}s "
                                   f"(dead ranks: {dead}; errors so far: {errors})") from None
            if ok:
                results[rank] = value
            else:
                errors[rank] = value
                timeout_s = min(timeout_s, 10.0)  # the others may now be stuck; don't wait long
        if errors:
            raise RankError(errors)
        return results

    def close(self):
        for box in self.inboxes:
            try:
                box.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()


class RankError(AssertionError):
    def __init__(self, errors: dict):
        self.errors = errors
        super().__init__("\n".join(f"[rank {r}] {e}" for r, e in sorted(errors.items())))


_pools: OrderedDict[int, Pool] = OrderedDict()


def run_ranks(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
    """``fn(*args, **kwargs)`` on every rank of a Gloo group of ``world_size``; the list of results."""
    pool = _pools.pop(world_size, None)
    if pool is None:
        pool = Pool(world_size)
        while len(_pools) >= MAX_POOLS:
            _pools.popitem(last=False)[1].close()
    try:
        results = pool.call(fn, args, kwargs, timeout_s)
    except BaseException:
        pool.close()
        raise
    _pools[world_size] = pool
    return results


@atexit.register
def close_all():
    while _pools:
        _pools.popitem()[1].close()
