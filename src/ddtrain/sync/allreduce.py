"""``ring``, ``ring-async``, ``tree``, ``butterfly``, ``central``: DDP with a ddtrain.comm all-reduce as its hook.

DDP keeps what makes it fast -- gradient buckets, launched as soon as the backward pass has
filled them -- and the communication hook decides how each bucket is reduced: here with one
of our own algorithms, ``all_reduce(bucket, algorithm, op="avg")`` (sum, then a division by
the world size done on data already identical on every rank, so every replica gets the same
bits).

The hand-written algorithms are synchronous point-to-point code, but DDP wants a
``torch.futures.Future`` back so that the backward pass can go on while the bucket travels:

* **CPU tensors (Gloo):** the hook hands the bucket to one communication thread per process
  and returns a future that thread completes. Buckets are reduced in the order DDP marks them
  ready, which is the same on every rank, and one thread keeps them in that order, so the
  ranks' point-to-point messages always match. Backward keeps computing the next buckets
  meanwhile; DDP waits on every future before it writes the averaged gradients.
* **CUDA tensors (NCCL):** the algorithms only *enqueue* work there (NCCL transfers on their
  streams, reductions on the current stream; see comm/p2p.py), so the hook runs the
  algorithm inline and returns a future already completed but bound to the device, which
  makes DDP's consumers wait on the stream, not the CPU.

Traffic is counted by the algorithms themselves (``ddtrain.comm.traffic``, method
"counted"); ``comm_wait_s`` is the time spent inside the algorithm, on the communication
thread for CPU tensors, so part of it overlaps the backward pass.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ddtrain import comm
from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import Strategy, SyncOptions
from ddtrain.sync.ddp import ddp_model
from ddtrain.sync.divergence import DivergenceMonitor


class HookState:
    """What the hook needs: the algorithm, the group, the ledger, and the communication thread."""

    def __init__(self, algorithm: str, group=None, ledger: Ledger | None = None):
        self.algorithm, self.group = algorithm, group
        self.ledger = ledger or Ledger((algorithm,))
        self.buckets = 0
        self._executor = None
        self._lock = threading.Lock()

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ddtrain-{self.algorithm}")
            return self._executor

    def reduce_(self, buffer: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            comm.all_reduce(buffer, self.algorithm, op="avg", group=self.group)
        finally:
            self.ledger.wait_s += time.perf_counter() - start
            self.buckets += 1
        return buffer

    def close(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def allreduce_hook(state: HookState, bucket):  # returns torch.futures.Future[torch.Tensor]
    """DDP communication hook: average ``bucket`` over the group with ``state.algorithm``."""
    buffer = bucket.buffer()
    if buffer.device.type == "cuda":
        future = torch.futures.Future(devices=[buffer.device])
        future.set_result(state.reduce_(buffer))
        return future
    future = torch.futures.Future()

    def run():
        try:
            future.set_result(state.reduce_(buffer))
        except BaseException as exc:  # handed to DDP, which raises it in the training thread
            future.set_exception(exc)

    state.executor().submit(run)
    return future


def hooked_ddp(model, options: SyncOptions, algorithm: str, ledger: Ledger | None = None):
    """(DDP-wrapped ``model`` whose buckets are averaged with ``algorithm``, its HookState)."""
    state = HookState(algorithm, None, ledger)
    return ddp_model(model, options, comm_hook=allreduce_hook, hook_state=state), state


class AllReduceStrategy(Strategy):
    """The strategy named ``algorithm``: DDP + that all-reduce on every gradient bucket."""

    def __init__(self, model, optimizer, options: SyncOptions, *, algorithm: str):
        ddp, self.hook = hooked_ddp(model, options, algorithm)
        super().__init__(ddp, optimizer, module=model)
        self.monitor = DivergenceMonitor(model, self.stats, None, options.check_every)

    def update_stats(self) -> None:
        self.hook.ledger.fill(self.stats)
        self.stats.extra["buckets_reduced"] = self.hook.buckets
        self.stats.extra["comm_wait_note"] = ("time inside the all-reduce; on CPU it runs on a communication "
                                             "thread and overlaps the backward pass")

    def close(self) -> None:
        self.hook.close()
