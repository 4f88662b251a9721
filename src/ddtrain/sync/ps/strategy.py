"""``ps-sync`` and ``ps-async`` as strategies: who is a server, who a worker, and what each does at the loop's hooks.

With ``--servers S`` the last S ranks are servers (``ParameterServer``: ``serve()`` is their whole
run) and ranks 0..W-1 are workers (``ParameterWorker``: the optimizer sends gradients and installs
the parameters the servers answer with), so rank 0 is always a worker and worker ranks equal
their index among the workers. ``ddtrain.world_size()``/``rank()`` then count workers
(``ddtrain.distributed.runtime.set_roles``) and ``ddtrain.worker_group()`` is the workers' process group.

A second model (``prepare`` called again, GAN-style) joins the running job: the workers say ADD
to the servers over the first model's messages; once every worker has, all ranks set the new
model up together (a process group for its messages, its parameters and optimizer sent from
rank 0 as objects) and each server serves it in a thread of its own.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch import nn

from ddtrain.distributed import runtime
from ddtrain.errors import ConfigError, DDTrainError
from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import Strategy, SyncOptions, SyncStats
from ddtrain.sync.buffers import BufferRule
from ddtrain.sync.divergence import DivergenceMonitor
from ddtrain.sync.ps import guard
from ddtrain.sync.ps.protocol import (ADD, COLLECTIVE, EPOCH_END, EVALUATION, REPLICA_CHECK, STOP, FailureNote, Plan,
                                     assign_shards, hyper_layout, make_plan, wire_dtype)
from ddtrain.sync.ps.serve_async import serve_async
from ddtrain.sync.ps.serve_sync import serve_sync
from ddtrain.sync.ps.server import ServerCore, connect_peers
from ddtrain.sync.ps.worker import WorkerLink, WorkerOptimizer, run_post_hooks
from ddtrain.sync.state import broadcast_, state_tensors

_JOB: dict = {}     # this process's running parameter-server job: {"first": ParameterWorker, "name", "servers"}


def user_class(optimizer) -> type:
    """The user's optimizer class (past ddtrain's prepared subclass, if one is given)."""
    cls = type(optimizer)
    while getattr(cls, "_ddtrain_prepared", False):
        cls = cls.__mro__[1]
    return cls


class ParameterServer(Strategy):
    """A server rank: ``serve()`` until every worker has sent STOP, for every model the workers prepare."""

    def __init__(self, model, optimizer, core: ServerCore, ledger: Ledger, options: SyncOptions, *, workers: int,
                 asynchronous: bool):
        super().__init__(model, optimizer, stats=core.stats, role="server", workers=workers, worker_rank=0)
        self.core, self.ledger, self.asynchronous, self.options = core, ledger, asynchronous, options
        self.stats.extra["server_parameters"] = sum(p.numel() for p in core.params)
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def serve(self) -> None:
        self._serve(self.core, self.add_model)
        for thread in self.threads:
            thread.join()
        if self.errors:
            raise self.errors[0]

    def _serve(self, core: ServerCore, on_add=None) -> None:
        if self.asynchronous:
            serve_async(core, self.options.staleness, self.options.async_rule, on_add=on_add)
        else:
            serve_sync(core, on_add=on_add)

    def add_model(self) -> None:
        """Every worker said ADD: set the new model up with them, then serve it in a thread."""
        plan, spec = set_up_added_model(self.core.plan.name, self.options, None, None, self.asynchronous)
        params, optimizer = rebuild(spec, plan.device)
        plan.shards = [[params[i] for i in shard] for shard in spec["shards"]]
        connect_peers(plan, dist.get_rank(), plan.device)
        index = plan.servers.index(dist.get_rank())
        core = ServerCore(plan, optimizer, index, Ledger(plan.operations()), SyncStats(), FailureNote(plan.name))

        def run():
            try:
                self._serve(core)
            except BaseException as exc:   # re-raised by serve() in the main thread
                self.errors.append(exc)

        thread = threading.Thread(target=run, name=f"ddtrain {plan.name} model {len(self.threads) + 2}", daemon=True)
        thread.start()
        self.threads.append(thread)

    def update_stats(self) -> None:
        self.ledger.fill(self.stats)


class WorkerModel(nn.Module):
    """What a worker's loop calls: the user's model, with the worker's work before and after each forward.

    ps-sync: DDP's buffer broadcast (``BufferRule``); ps-async: the HELLO a paused worker says
    before computing, and the PAUSE before an evaluation. A wrapper, not hooks on the user's
    model, so that the model deep-copies and pickles as the plain module it is.
    """

    def __init__(self, module: nn.Module, worker: ParameterWorker):
        super().__init__()
        self.module = module
        object.__setattr__(self, "_worker", worker)   # not a submodule

    def forward(self, *args, **kwargs):
        self._worker.before_forward()
        out = self.module(*args, **kwargs)
        self._worker.after_forward()
        return out


class ParameterWorker(Strategy):
    """A worker rank: ``optimizer.step()`` pushes gradients and pulls parameters; ``finish`` sends STOP.

    The user's optimizer keeps no state here (the servers hold it): its ``state_dict()`` fetches
    the state from the servers and its ``load_state_dict()`` installs it there (torch's optimizer
    state-dict hooks), and at ``finish`` the final state is copied into it. While it runs, the
    script's collectives on the default group are refused and, under ps-async, the others pause
    it first (``guard``).
    """

    def __init__(self, model, optimizer, link: WorkerLink, ledger: Ledger, stats: SyncStats, options: SyncOptions, *,
                 workers: int, group, asynchronous: bool):
        super().__init__(WorkerModel(model, self), WorkerOptimizer(optimizer, link), module=model, stats=stats,
                         workers=workers, worker_rank=dist.get_rank(), group=group)
        self.link, self.ledger, self.asynchronous = link, ledger, asynchronous
        self.name, self.servers = link.plan.name, link.plan.servers
        self.user_optimizer = optimizer     # ``no_sync()`` is Strategy's: inside it nothing is sent, as always in backward
        self.monitor = DivergenceMonitor(model, stats, group, options.check_every)
        self.hooks = [optimizer.register_state_dict_post_hook(self._state_dict_from_servers),
                      optimizer.register_load_state_dict_pre_hook(self._load_state_dict_on_servers)]
        # ps-sync's workers step together: DDP's buffer broadcast among them. ps-async's do not (module doc of buffers).
        self.buffers = BufferRule(model, group, options.broadcast_buffers and not asynchronous)
        if asynchronous:
            # The staleness gate must know which workers compute: a worker starts paused, says
            # HELLO before its first training forward, and pauses before anything that waits on
            # the other workers (evaluation, collectives among them, divergence checks, the
            # loop's epoch-end metrics and validation).
            link.paused = True
        guard.install(self)

    def before_forward(self) -> None:
        training = self.module.training and torch.is_grad_enabled()
        if self.asynchronous and training:
            self.link.hello_if_paused()
        elif self.asynchronous and not self.link.holds_gradient():
            # an evaluation (or a forward outside any step): the others may soon wait for this worker
            self.link.pause(EVALUATION)
        self.buffers.before_forward()

    def after_forward(self) -> None:
        self.buffers.after_forward(torch.is_grad_enabled() and self.require_backward_grad_sync)

    def before_collective(self, what: str) -> None:
        """ps-async: the script is about to wait for the other workers; leave the gate first (``guard``)."""
        if not self.asynchronous or self.link.paused:
            return
        if self.link.holds_gradient():
            raise DDTrainError(f"{self.name}: worker rank {dist.get_rank()} called {what} between loss.backward() "
                               "and optimizer.step(): the servers may hold the other workers' gradients until this "
                               "one's arrives, while they wait for it in the collective; call it after "
                               "optimizer.step() (ps-async only)")
        self.link.pause(COLLECTIVE)

    def _state_dict_from_servers(self, optimizer, state_dict: dict) -> dict:
        state_dict["state"] = self.link.state()
        return state_dict

    def _load_state_dict_on_servers(self, optimizer, state_dict: dict) -> dict:
        self.link.load_state(state_dict["state"])
        return {"state": {}, "param_groups": state_dict["param_groups"]}   # the groups' values here, the state there

    def optimizer_step(self, optimizer, user_step, closure=None):
        """The prepared optimizer's step: push the gradients, install the servers' parameters."""
        if self.accumulating > 0 or not self.require_backward_grad_sync:
            raise DDTrainError(f"{self.name}: optimizer.step() inside model.no_sync() (or with "
                               "model.require_backward_grad_sync = False): the parameter servers apply the step; "
                               "call step() after leaving no_sync() (after setting it back to True)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.link.step()
        run_post_hooks(self.user_optimizer)
        return loss

    def after_step(self, step: int) -> None:
        if self.asynchronous and self.monitor.check_due():
            self.link.pause(REPLICA_CHECK)
        super().after_step(step)

    def end_epoch(self, epoch: int) -> None:
        if self.asynchronous:
            self.link.pause(EPOCH_END)
        super().end_epoch(epoch)

    def update_stats(self) -> None:
        self.ledger.fill(self.stats)

    def close(self) -> None:
        try:
            final = self.link.state()
            self.link.exchange(STOP, "stop")
        finally:
            guard.uninstall(self)
            for hook in self.hooks:
                hook.remove()
        groups = self.user_optimizer.state_dict()["param_groups"]
        self.user_optimizer.load_state_dict({"state": final, "param_groups": groups})   # the servers are gone now
        if _JOB.get("first") is self:
            _JOB.clear()


def set_up_added_model(name: str, options: SyncOptions, model, optimizer, asynchronous: bool):
    """Every rank (workers with ``model``/``optimizer``, servers with None): the added model's plan and spec.

    Rank 0 sends the parameters' values and the optimizer's class, defaults and groups (as an
    object: the servers never built this model); every rank creates the model's process group
    (and on NCCL for ps-async a group per worker-server pair) in the same order. The plan's
    shards are filled by the caller: ``spec["shards"]`` holds each server's parameter indices.
    """
    spec = None
    if model is not None and dist.get_rank() == 0:
        params = [p for p in model.parameters() if p.requires_grad]
        ids = {id(p): i for i, p in enumerate(params)}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [ids[id(p)] for p in g["params"] if id(p) in ids]} for g in optimizer.param_groups]
        spec = {"values": [p.detach().cpu() for p in params], "class": user_class(optimizer),
                "defaults": optimizer.defaults, "groups": groups,
                "buffers": [b.detach().cpu() for b in model.buffers() if b.is_floating_point()]}
    box = [spec]
    dist.broadcast_object_list(box, src=0)
    spec = box[0]
    world, servers = dist.get_world_size(), options.servers
    owner = assign_shards([v.numel() for v in spec["values"]], servers)
    spec["shards"] = [[i for i, o in enumerate(owner) if o == s] for s in range(servers)]
    plan = Plan(name, list(range(world - servers)), list(range(world - servers, world)), [],
                spec["values"][0].dtype, runtime.device(), options.timeout_s or runtime.timeout_s(),
                hyper=hyper_layout(spec["groups"]), group=dist.new_group(list(range(world))))
    if asynchronous and dist.get_backend() == "nccl":
        plan.pairs = {(w, srv): dist.new_group([w, srv]) for w in plan.workers for srv in plan.servers}
    plan.wire_dtype = wire_dtype(options.compression)
    return plan, spec


def rebuild(spec: dict, device):
    """A server's copy of the added model's parameters and an optimizer of the user's class over them."""
    params = [torch.nn.Parameter(v.to(device).clone()) for v in spec["values"]]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[i] for i in g["params"]]}
              for g in spec["groups"]]
    try:
        return params, spec["class"](groups, **spec["defaults"])
    except TypeError:   # a class whose defaults are not its keyword arguments: the groups carry every value
        return params, spec["class"](groups)


def build_param_server(model, optimizer, options: SyncOptions, *, asynchronous: bool = False) -> Strategy:
    """Apply ``ps-sync`` (or ``ps-async``) on this rank: a ParameterServer or a ParameterWorker.

    Every rank creates the workers' group (and on NCCL for ps-async a group per worker-server
    pair) in the same order, then rank 0's parameters and buffers are broadcast once, so
    servers and workers start from the same state. A second call in the same job (servers are
    serving already) adds the model instead (``add_worker_model``).
    """
    name = "ps-async" if asynchronous else "ps-sync"
    if not isinstance(optimizer, torch.optim.Optimizer):
        # the servers run the optimizer: they need exactly one, over this model's parameters
        raise DDTrainError(f"{name}: the parameter servers run the model's optimizer, so prepare() needs exactly one "
                           f"torch.optim.Optimizer per model (got {type(optimizer).__name__}); prepare models with "
                           "several optimizers one model at a time, or use one optimizer with several param groups")
    if _JOB:
        return add_worker_model(name, model, optimizer, options, asynchronous)
    world = dist.get_world_size()
    if options.servers >= world:
        raise ConfigError("servers", f"{options.servers} leaves no worker among {world} ranks ({name}); "
                                     f"use at least {options.servers + 1} processes")
    rank = dist.get_rank()
    plan = make_plan(name, model, options.servers, options.timeout_s, world, optimizer)
    plan.wire_dtype = wire_dtype(options.compression)
    worker_group = dist.new_group(plan.workers)          # every rank, same order
    if asynchronous and dist.get_backend() == "nccl":
        # a group per worker-server pair, created by every rank in the same order (see serve_async)
        plan.pairs = {(w, srv): dist.new_group([w, srv]) for w in plan.workers for srv in plan.servers}
    broadcast_(state_tensors(model), counted=False)      # servers and workers start alike
    connect_peers(plan, rank, next(model.parameters()).device)
    runtime.set_roles(plan.workers, plan.servers, worker_group)
    ledger, stats, note = Ledger(plan.operations()), SyncStats(), FailureNote(name)
    if rank in plan.servers:
        core = ServerCore(plan, optimizer, plan.servers.index(rank), ledger, stats, note)
        return ParameterServer(model, optimizer, core, ledger, options, workers=len(plan.workers),
                               asynchronous=asynchronous)
    worker = ParameterWorker(model, optimizer, WorkerLink(plan, ledger, note, optimizer), ledger, stats, options,
                             workers=len(plan.workers), group=worker_group, asynchronous=asynchronous)
    _JOB.update(first=worker, name=name, servers=options.servers, group=worker_group)
    return worker


def add_worker_model(name: str, model, optimizer, options: SyncOptions, asynchronous: bool) -> Strategy:
    """A worker's second (third...) model in a running job: ADD over the first model's link, then set it up."""
    first = _JOB["first"]
    if name != _JOB["name"] or options.servers != _JOB["servers"]:
        raise ConfigError("servers", f"{options.servers} ({name}): this job's parameter servers already serve "
                                     f"{_JOB['name']} with servers {_JOB['servers']}; every prepare() of a job must "
                                     "use the same strategy and servers", mentions=("servers",))
    first.link.exchange(ADD, "add a model")
    if asynchronous:
        first.link.paused = True       # the server took it out of the gate; its next forward says HELLO
    plan, spec = set_up_added_model(name, options, model, optimizer, asynchronous)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():              # every worker starts from rank 0's values
        for p, v in zip(params, spec["values"]):
            p.copy_(v)
        for b, v in zip([b for b in model.buffers() if b.is_floating_point()], spec["buffers"]):
            b.copy_(v)
    plan.shards = [[params[i] for i in shard] for shard in spec["shards"]]
    plan.dtype, plan.device = params[0].dtype, params[0].device
    connect_peers(plan, dist.get_rank(), plan.device)
    ledger, stats = Ledger(plan.operations()), SyncStats()
    return ParameterWorker(model, optimizer, WorkerLink(plan, ledger, FailureNote(name), optimizer), ledger, stats,
                           options, workers=len(plan.workers), group=_JOB["group"], asynchronous=asynchronous)
