"""ddtrain: data-parallel training on torch.distributed, with every synchronisation method of
the literature behind one switch, and the measurements to choose between them.

    import ddtrain
    ddtrain.init()
    model, optimizer, loader = ddtrain.prepare(model, optimizer, loader, strategy="ring")
    ...
    ddtrain.shutdown()
"""
__version__ = "0.1.0"

from ddtrain.config import TrainConfig
from ddtrain.dist.runtime import (backend, device, init, is_distributed, local_rank, local_world_size, print0, rank,
                                  shutdown, world_size)
from ddtrain.errors import DDTrainError
from ddtrain.training.callbacks import Callback
from ddtrain.training.loop import fit
from ddtrain.training.prepare import prepare

__all__ = ["init", "shutdown", "prepare", "fit", "Callback", "TrainConfig", "DDTrainError", "rank",
           "world_size", "local_rank", "local_world_size", "device", "backend", "is_distributed", "print0",
           "__version__"]
