"""The model ``prepare`` returns: one wrapper kind for every strategy and world size.

``PreparedModel`` holds the user's model as ``.module`` (as DDP does) and calls it through the
strategy (DDP with or without a communication hook, a parameter-server worker's wrapper, or the
bare model where a strategy communicates elsewhere or the world size is 1) -- every forward,
evaluation under ``no_grad`` included, so DDP's rule for buffers holds on every strategy that
has it (``ddtrain.sync.buffers``): a plain-DDP script evaluates with rank 0's BatchNorm
statistics, and so does its port. Its ``state_dict()`` is the bare model's, so checkpoint keys
never depend on strategy or world size, and ``load_state_dict`` also takes a checkpoint saved
from a plain DDP model (keys prefixed ``module.``). Attributes it does not have are looked up
on ``.module`` (``model.fc`` keeps working after ``prepare``); DDP's
``require_backward_grad_sync`` is honoured on every strategy.

A copy of a prepared model (``copy.deepcopy``, ``copy.copy``, pickling, ``torch.save(model)``)
is a copy of the bare module: an EMA or a saved model does not take part in the strategy's
communication, and loads without ddtrain or a process group.
"""
from __future__ import annotations

import copy

from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present


class PreparedModel(nn.Module):
    """``module``: the user's model; ``strategy``: the ddtrain.sync Strategy applied to it."""

    def __init__(self, module: nn.Module, strategy):
        super().__init__()
        self.module = module
        # not registered as submodules: ``parameters()``/``modules()`` see the user's model once
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "_runner", strategy.model)
        self.training = module.training     # as the user left it (no recursive train(), which would reset submodules)

    def forward(self, *args, **kwargs):
        return self._runner(*args, **kwargs)

    def no_sync(self):
        """Accumulate gradients without communicating, for every strategy (``Strategy.no_sync``)."""
        return self.strategy.no_sync()

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch: set False before a micro-batch's forward to skip its gradient sync (nanoGPT), as ``no_sync()``."""
        return self.strategy.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.strategy.require_backward_grad_sync = value

    def __copy__(self):
        return copy.copy(self.module)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self.module, memo)

    def __reduce_ex__(self, protocol):
        # pickled (torch.save(model)) as the bare module, which unpickles as itself: (module,)[0], builtins only,
        # so the file loads without ddtrain; hooks, process groups and threads stay here
        return tuple.__getitem__, ((self.module,), 0)

    def train(self, mode: bool = True):
        super().train(mode)
        if self._runner is not self.module:
            self._runner.train(mode)     # DDP's own flag, which it reads in forward
        return self

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if state_dict and all(key.startswith("module.") for key in state_dict):
            state_dict = dict(state_dict)
            consume_prefix_in_state_dict_if_present(state_dict, "module.")   # saved from plain DDP
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")   # absent while copy/pickle rebuilds the object
            if name == "module" or name.startswith("__") or not modules or "module" not in modules:
                raise
            return getattr(modules["module"], name)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's bare model inside ``model``: through PreparedModel, DDP and ``torch.compile``'s wrappers."""
    while True:
        if isinstance(model, (PreparedModel, nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model
