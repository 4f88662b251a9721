"""ddtrain: data-parallel training on torch.distributed, with every synchronisation method of
the literature behind one switch, and the measurements to choose between them.

    import ddtrain
    ddtrain.init()
    model, optimizer, loader = ddtrain.prepare(model, optimizer, loader, strategy="ring")
    ...
    ddtrain.shutdown()
"""
from ddtrain.version import __version__

# The public names, imported on first use (PEP 562): ``ddtrain --help`` and the command table
# answer without importing torch (1.5-5 s on these machines), and a command imports only its own
# modules.
_PUBLIC = {
    "TrainConfig": "ddtrain.config",
    "DDTrainError": "ddtrain.errors",
    "Callback": "ddtrain.training.callbacks",
    "fit": "ddtrain.training.loop",
    "prepare": "ddtrain.training.prepare",
    "init": "ddtrain.training.prepare",   # runtime.init, plus the roles a parameter-server strategy named there gives
    "prepare_loader": "ddtrain.training.prepare",
    "unwrap": "ddtrain.training.prepare",
    "comm_hook": "ddtrain.sync.hook",   # ddtrain's algorithms and compressors as a hook for a user's own DDP
    "all_reduce_metric": "ddtrain.training.metrics",
    "gather_for_metrics": "ddtrain.training.metrics",
    **dict.fromkeys(("save_state", "load_state", "stop_requested", "register_for_checkpointing"),
                    "ddtrain.training.state"),
    **dict.fromkeys(("backend", "device", "is_distributed", "is_server", "local_rank", "local_world_size", "print0",
                     "rank", "shutdown", "total_ranks", "worker_group", "world_size"), "ddtrain.distributed.runtime"),
}

__all__ = [*_PUBLIC, "__version__"]  # noqa: PLE0604 (the keys of _PUBLIC are strings)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ddtrain' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_PUBLIC])
