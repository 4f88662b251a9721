"""A script's own ``torch.distributed`` collectives in a parameter-server job: refused on the default group, safe among workers.

The default process group holds the server ranks too, and they spend the whole run serving
(``prepare`` never returns on them), so a collective the script calls on it -- ``dist.barrier()``,
``dist.all_reduce(t)``, a group made with ``dist.new_group`` -- waits for them until the process
group's timeout and then fails naming nobody. ps-async adds a second trap: a worker that waits
for the other workers while the servers hold their gradients for its own (the staleness bound)
deadlocks with them, which is what evaluating together mid-epoch did (issue 29).

While a parameter-server job runs, the workers' ``torch.distributed.<collective>`` functions are
wrapped (``install``; put back by ``uninstall`` at the strategy's finish):

* a call from the script on the default group fails at once with the one-line fix
  (``group=ddtrain.worker_group()``); group creation, which needs every rank, likewise;
* under ps-async any other collective first takes this worker out of the servers' gate
  (``ParameterWorker.before_collective``: PAUSE), as ``ddtrain.all_reduce_metric`` and
  ``gather_for_metrics`` do (``before_collective``), so the others never wait on its gradient.

Why wrap torch's functions: a collective the servers can never join is only visible to ddtrain
at the call; after it the worker is blocked inside the backend. The wrapper is installed on
workers only, only while the job runs, looks at the ``group`` argument and nothing else, and
passes every call from ddtrain itself (which knows whom its collectives involve) and every call
on another group through unchanged. Calling torch.distributed's function imported before
``prepare`` under another name (``from torch.distributed import barrier``) is not seen.
"""
from __future__ import annotations

import functools
import inspect
import sys

import torch.distributed as dist

from ddtrain.errors import DDTrainError

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "all_reduce",
               "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "broadcast",
               "broadcast_object_list", "gather", "gather_object", "monitored_barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "scatter", "scatter_object_list")
GROUP_MAKERS = ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group")

_workers: list = []          # this process's ParameterWorkers (one per prepared model), while the job runs
_originals: dict = {}        # name -> torch.distributed's own function, while wrapped


def before_collective(what: str) -> None:
    """Every running parameter-server worker of this process is about to wait for the other workers."""
    for worker in list(_workers):
        worker.before_collective(what)


def install(worker) -> None:
    """Watch the script's collectives while ``worker``'s job runs (the first worker wraps torch.distributed)."""
    _workers.append(worker)
    if _originals:
        return
    for name in COLLECTIVES + GROUP_MAKERS:
        original = getattr(dist, name, None)
        if original is not None:
            _originals[name] = original
            setattr(dist, name, _wrapped(name, original))


def uninstall(worker) -> None:
    """``worker``'s job is over; the last one puts torch.distributed's functions back."""
    if worker in _workers:
        _workers.remove(worker)
    if not _workers:
        for name, original in _originals.items():
            setattr(dist, name, original)
        _originals.clear()


def _from_ddtrain(depth: int = 2) -> bool:
    """Was the wrapped function called from ddtrain's own code (``depth`` frames up)?"""
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name == "ddtrain" or name.startswith("ddtrain.")


def default_group_message(name: str) -> str:
    worker = _workers[0]
    servers = ", ".join(map(str, worker.servers))
    return (f"{worker.name}: worker rank {dist.get_rank()} called torch.distributed.{name}() on the default process "
            f"group, which also holds the parameter-server rank(s) {servers}; they serve and never join the "
            f"script's collectives, so it would wait until the timeout. Pass the workers' group: "
            f"dist.{name}(..., group=ddtrain.worker_group()) (and count ranks with ddtrain.world_size())")


def _wrapped(name: str, original):
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None
    maker = name in GROUP_MAKERS

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        if _workers and not _from_ddtrain():
            if maker:
                worker = _workers[0]
                raise DDTrainError(f"{worker.name}: worker rank {dist.get_rank()} called torch.distributed.{name}(), "
                                   "which every rank of the job must call, and the parameter servers serve instead; "
                                   "make the group before ddtrain.prepare(), or use ddtrain.worker_group()")
            if _on_default_group(signature, args, kwargs):
                raise DDTrainError(default_group_message(name))
            before_collective(f"torch.distributed.{name}")
        return original(*args, **kwargs)

    return guarded


def _on_default_group(signature, args, kwargs) -> bool:
    if signature is None or "group" not in signature.parameters:
        return False
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return False          # torch's own function will say what is wrong with the call
    group = bound.arguments.get("group", signature.parameters["group"].default)
    return group is None or group is dist.GroupMember.WORLD
