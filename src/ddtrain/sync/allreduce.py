"""``ring``, ``ring-async``, ``tree``, ``butterfly``, ``central``: DDP with a ddtrain.comm all-reduce as its hook.

DDP keeps what makes it fast -- gradient buckets, launched as soon as the backward pass has
filled them -- and the communication hook reduces each bucket with one of our algorithms,
``all_reduce(bucket, algorithm, op="avg")``, so every replica gets the same bits. Traffic is
counted by the algorithms themselves (method "counted"); ``comm_wait_s`` is the time inside
the algorithm, on the communication thread for CPU tensors, so part of it overlaps backward.

With ``--compression`` (``ddtrain.comm.compression``) the hook hands each bucket to the
compressor instead, which compresses it, reduces the compressed tensors with the same
algorithm and decompresses into the bucket; ``ddp`` with compression is this hook over the
``native`` all-reduce (``build_ddp``). The counters then hold the compressed bytes.
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ddtrain import comm
from ddtrain.comm import compression
from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import Strategy, SyncOptions
from ddtrain.sync.ddp import DDPStrategy, ddp_model
from ddtrain.sync.divergence import DivergenceMonitor


class CommThread:
    """The process's one communication thread, shared by every hooked DDP model (a GAN prepares two).

    The algorithms exchange point-to-point messages matched by order, so the buckets of all the
    models of a process must be reduced one after the other, in the order backward marks them
    ready -- the same on every rank. Two threads (one per model) would interleave their messages
    differently on each rank and mismatch them.
    """

    _lock = threading.Lock()
    _executor: ThreadPoolExecutor | None = None
    _users = 0

    @classmethod
    def acquire(cls) -> ThreadPoolExecutor:
        with cls._lock:
            if cls._executor is None:
                cls._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddtrain-comm")
            cls._users += 1
            return cls._executor

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._users -= 1
            if cls._users == 0 and cls._executor is not None:
                cls._executor.shutdown(wait=True)
                cls._executor = None


class HookState:
    """What the hook needs: the algorithm, the compressor (or None), the group, the ledger, the communication thread."""

    def __init__(self, algorithm: str, group=None, ledger: Ledger | None = None, compression_spec: str = "none"):
        self.algorithm, self.group = algorithm, group
        self.compression = compression_spec
        self.compressor = compression.build(compression_spec)   # per model: it keeps per-tensor state
        self.positions: dict = {}     # id(parameter) -> its position in model.parameters(): the compressor's tensor keys
        self.shapes: dict = {}        # position -> shape, to check a restored compressor state against
        self.layout: dict = {}        # bucket index -> its parameters' positions, as DDP last cut them
        self.replay: list | None = None   # the saved buckets a restarted DDP's first step is reduced as
        self.ledger = ledger or Ledger(compression.collective_operations(compression_spec, algorithm))
        self.buckets = 0
        self._executor = None
        self._lock = threading.Lock()

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = CommThread.acquire()
            return self._executor

    def name_parameters(self, model: torch.nn.Module) -> None:
        """Key the compressor's state by each parameter's position in ``model``: the same in every process."""
        params = list(model.parameters())
        self.positions = {id(p): i for i, p in enumerate(params)}
        self.shapes = {i: tuple(p.shape) for i, p in enumerate(params)}

    def reduce_(self, buffer: torch.Tensor, shapes=None, key: int = 0, last: bool = True, keys=None) -> torch.Tensor:
        start = time.perf_counter()
        try:
            replay = self._replay_for(keys)
            if replay is None:
                self._reduce_bucket(buffer, shapes, key, last, keys)
            else:
                self._reduce_as(replay, buffer, shapes, last, keys)
        finally:
            self.ledger.wait_s += time.perf_counter() - start
            self.buckets += 1
        return buffer

    def _reduce_bucket(self, buffer, shapes, key, last, keys) -> None:
        if keys is not None:
            self.layout[key] = list(keys)
            if last:   # a rebuild may leave fewer buckets than before
                self.layout = {k: v for k, v in self.layout.items() if k <= key}
        if self.compressor is None:
            comm.all_reduce(buffer, self.algorithm, op="avg", group=self.group)
        else:
            self.compressor.all_reduce_(buffer, shapes, algorithm=self.algorithm, group=self.group, key=key,
                                        keys=keys, last=last)

    def _replay_for(self, keys) -> list | None:
        """The saved buckets to reduce this bucket as, on a restarted DDP's first step (None: as DDP cut it).

        A new DDP trains its first step with one bucket of every parameter in model order and
        rebuilds its buckets afterwards from the order gradients became ready, the order the run
        being resumed had used since its own first step. On 3 or more ranks the bits of a sum
        depend on where an element sits in the buffer, so the restarted first step reduces its
        bucket in the saved buckets' pieces and order: the same bits as the uninterrupted run.
        """
        if self.replay is None or keys is None:
            return None
        saved = [bucket for bucket in self.replay if bucket]
        if any(list(keys) == bucket for bucket in saved):   # DDP has rebuilt its buckets as they were: done
            self.replay = None
            return None
        wanted = set(keys)
        inside = [bucket for bucket in saved if set(bucket) <= wanted]
        if sum(len(bucket) for bucket in inside) != len(wanted):
            self.replay = None   # another cut than the saved one (another bucket size): reduced as it comes
            return None
        return inside

    def _reduce_as(self, replay: list, buffer, shapes, last: bool, keys) -> None:
        views, at = {}, 0
        for name, shape in zip(keys, shapes):
            n = math.prod(shape)
            views[name] = buffer[at:at + n]
            at += n
        for index, bucket in enumerate(replay):
            piece = torch.cat([views[name] for name in bucket])
            self._reduce_bucket(piece, [self.shapes[name] for name in bucket], index,
                                last and index == len(replay) - 1, bucket)
            at = 0
            for name in bucket:
                views[name].copy_(piece[at:at + views[name].numel()])
                at += views[name].numel()

    def compressor_state_dict(self) -> dict:
        """This rank's compressor state with the method that wrote it, and DDP's buckets (parameter positions)."""
        state = {"buckets": [self.layout[k] for k in sorted(self.layout)]} if self.layout else {}
        if self.compressor is not None:
            state.update(compression=self.compression, state=self.compressor.state_dict())
        return state

    def load_compressor_state_dict(self, saved: dict) -> str | None:
        """Take back ``compressor_state_dict()``'s state; a note when it is not taken (another method, or none).

        ValueError when its pieces do not fit this model (a state of another model, or edited).
        """
        buckets = saved.get("buckets") if saved else None
        if buckets and all(isinstance(b, list) and all(k in self.shapes for k in b) for b in buckets):
            self.replay = [list(b) for b in buckets]
        if not saved or "compression" not in saved:
            return None if self.compressor is None else \
                f"no compressor state saved: {self.compression} starts afresh (error feedback zero)"
        if saved["compression"] != self.compression:
            return (f"the compressor state of compression {saved['compression']} is not restored: this run "
                    + (f"compresses with {self.compression}, which starts afresh" if self.compressor is not None
                       else "compresses nothing"))
        self.compressor.load_state_dict(saved["state"], self.shapes or None)
        return None

    def close(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor = None
                CommThread.release()


def allreduce_hook(state: HookState, bucket):  # returns torch.futures.Future[torch.Tensor]
    """DDP communication hook: average ``bucket`` over the group with ``state.algorithm``.

    The algorithms are synchronous point-to-point code, but DDP wants a future back so that
    backward can go on while the bucket travels. CUDA tensors (NCCL): the algorithms only
    enqueue work (transfers on NCCL's streams, reductions on the current stream; comm/p2p.py),
    so the hook runs inline and returns a completed future bound to the device, which makes
    DDP's consumers wait on the stream, not the CPU. CPU tensors (Gloo): one communication
    thread per process (``CommThread``) reduces the buckets in the order DDP marks them ready, the same on
    every rank, so the ranks' messages always match; DDP waits on every future before it
    writes the averaged gradients.
    """
    buffer = bucket.buffer()
    # what a compressor needs to know of the bucket, read here: the bucket object is DDP's, valid during the call
    shapes = [g.shape for g in bucket.gradients()]
    keys = [state.positions[id(p)] for p in bucket.parameters()] if state.positions else None
    where = (shapes, bucket.index(), bucket.is_last(), keys)
    if buffer.device.type == "cuda":
        future = torch.futures.Future(devices=[buffer.device])
        future.set_result(state.reduce_(buffer, *where))
        return future
    future = torch.futures.Future()

    def run():
        try:
            future.set_result(state.reduce_(buffer, *where))
        except BaseException as exc:  # handed to DDP, which raises it in the training thread
            future.set_exception(exc)

    state.executor().submit(run)
    return future


def hooked_ddp(model, options: SyncOptions, algorithm: str, ledger: Ledger | None = None):
    """(DDP-wrapped ``model`` whose buckets are averaged with ``algorithm``, its HookState)."""
    state = HookState(algorithm, None, ledger, options.compression)
    state.name_parameters(model)
    return ddp_model(model, options, comm_hook=allreduce_hook, hook_state=state), state


class AllReduceStrategy(Strategy):
    """The strategy named ``algorithm``: DDP + that all-reduce on every gradient bucket."""

    def __init__(self, model, optimizer, options: SyncOptions, *, algorithm: str):
        ddp, self.hook = hooked_ddp(model, options, algorithm)
        self.compression = options.compression
        super().__init__(ddp, optimizer, module=model)
        self.monitor = DivergenceMonitor(model, self.stats, None, options.check_every)

    def update_stats(self) -> None:
        self.hook.ledger.fill(self.stats)
        self.stats.extra["buckets_reduced"] = self.hook.buckets
        self.stats.extra["compression"] = self.compression
        self.stats.extra["comm_wait_note"] = ("time inside the all-reduce; on CPU it runs on a communication "
                                             "thread and overlaps the backward pass")

    def compressor_state_dict(self) -> dict:
        return self.hook.compressor_state_dict()

    def load_compressor_state_dict(self, state: dict) -> str | None:
        return self.hook.load_compressor_state_dict(state)

    def close(self) -> None:
        self.hook.close()


def build_ddp(model, optimizer, options: SyncOptions):
    """``ddp``: DDP's own all-reduce, or with ``--compression`` the compression hook over the ``native`` all-reduce."""
    if options.compression == "none":
        return DDPStrategy(model, optimizer, options)
    return AllReduceStrategy(model, optimizer, options, algorithm="native")
