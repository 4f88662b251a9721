"""``ps-sync`` and ``ps-async`` as strategies: who is a server, who a worker, and what each does at the loop's hooks.

With ``--servers S`` the last S ranks are servers (``ParameterServer``: ``serve()`` is their whole
run) and ranks 0..W-1 are workers (``ParameterWorker``: the optimizer sends gradients and installs
the parameters the servers answer with), so rank 0 is always a worker and worker ranks equal
their index among the workers.
"""
from __future__ import annotations

import torch.distributed as dist

from ddtrain.errors import DDTrainError
from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import Strategy, SyncOptions, SyncStats
from ddtrain.sync.divergence import DivergenceMonitor
from ddtrain.sync.ps.protocol import STOP, FailureNote, make_plan
from ddtrain.sync.ps.serve_async import serve_async
from ddtrain.sync.ps.serve_sync import serve_sync
from ddtrain.sync.ps.server import ServerCore, connect_peers
from ddtrain.sync.ps.worker import WorkerLink, WorkerOptimizer
from ddtrain.sync.state import broadcast_, state_tensors


class ParameterServer(Strategy):
    """A server rank: ``serve()`` until every worker has sent STOP."""

    def __init__(self, model, optimizer, core: ServerCore, ledger: Ledger, *, workers: int,
                 asynchronous: bool, staleness: int):
        super().__init__(model, optimizer, stats=core.stats, role="server", workers=workers, worker_rank=0)
        self.core, self.ledger, self.asynchronous, self.staleness = core, ledger, asynchronous, staleness
        self.stats.extra["server_parameters"] = sum(p.numel() for p in core.params)

    def serve(self) -> None:
        if self.asynchronous:
            serve_async(self.core, self.staleness)
        else:
            serve_sync(self.core)

    def update_stats(self) -> None:
        self.ledger.fill(self.stats)


class ParameterWorker(Strategy):
    """A worker rank: ``optimizer.step()`` pushes gradients and pulls parameters; ``finish`` sends STOP."""

    def __init__(self, model, optimizer, link: WorkerLink, ledger: Ledger, stats: SyncStats, options: SyncOptions, *,
                 workers: int, group, asynchronous: bool):
        super().__init__(model, WorkerOptimizer(optimizer, link), stats=stats, workers=workers,
                         worker_rank=dist.get_rank(), group=group)
        self.link, self.ledger, self.asynchronous = link, ledger, asynchronous
        self.monitor = DivergenceMonitor(model, stats, group, options.check_every)
        if asynchronous:
            # The staleness gate must know which workers compute: a worker starts paused, says
            # HELLO before its first training forward, and pauses before anything that waits on
            # the other workers (divergence checks, the loop's epoch-end metrics and validation).
            link.paused = True
            model.register_forward_pre_hook(link.hello_if_paused)

    def after_step(self, step: int) -> None:
        if self.asynchronous and self.monitor.check_due():
            self.link.pause()
        super().after_step(step)

    def end_epoch(self, epoch: int) -> None:
        if self.asynchronous:
            self.link.pause()
        super().end_epoch(epoch)

    def update_stats(self) -> None:
        self.ledger.fill(self.stats)

    def close(self) -> None:
        self.link.exchange(STOP, "stop")


def build_param_server(model, optimizer, options: SyncOptions, *, asynchronous: bool = False) -> Strategy:
    """Apply ``ps-sync`` (or ``ps-async``) on this rank: a ParameterServer or a ParameterWorker.

    Every rank creates the workers' group (and on NCCL for ps-async a group per worker-server
    pair) in the same order, then rank 0's parameters and buffers are broadcast once, so
    servers and workers start from the same state.
    """
    name = "ps-async" if asynchronous else "ps-sync"
    world = dist.get_world_size()
    if options.servers >= world:
        raise DDTrainError(f"{name}: --servers {options.servers} leaves no worker among {world} ranks; "
                           f"use at least {options.servers + 1} processes")
    rank = dist.get_rank()
    plan = make_plan(name, model, options.servers, options.timeout_s, world)
    worker_group = dist.new_group(plan.workers)          # every rank, same order
    if asynchronous and dist.get_backend() == "nccl":
        # a group per worker-server pair, created by every rank in the same order (see serve_async)
        plan.pairs = {(w, srv): dist.new_group([w, srv]) for w in plan.workers for srv in plan.servers}
    broadcast_(state_tensors(model), counted=False)      # servers and workers start alike
    connect_peers(plan, rank, next(model.parameters()).device)
    ledger, stats, note = Ledger(plan.operations()), SyncStats(), FailureNote(name)
    if rank in plan.servers:
        core = ServerCore(plan, optimizer, plan.servers.index(rank), ledger, stats, note)
        return ParameterServer(model, optimizer, core, ledger, workers=len(plan.workers),
                               asynchronous=asynchronous, staleness=options.staleness)
    return ParameterWorker(model, optimizer, WorkerLink(plan, ledger, note), ledger, stats, options,
                           workers=len(plan.workers), group=worker_group, asynchronous=asynchronous)
