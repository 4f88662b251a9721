"""What a rank holds: its parameter, gradient and optimizer-state bytes, measured at the optimizer step.

Sharded strategies exist to shrink these, so the record shows them for every strategy
(``stats.extra["memory"]``, one per rank in the run record's ``comm``), measured, not derived:

- ``parameter_bytes``: the storage of the model's parameters and of any other tensor the
  optimizer steps (ZeRO's shard copies), local shards only (FSDP's DTensors count what this rank holds);
- ``gradient_bytes``: the storage of the gradients held when the optimizer steps (the model's
  ``.grad`` and the stepped tensors' ``.grad``; views of one buffer count once), the largest over the steps;
- ``optimizer_state_bytes``: the tensors in ``optimizer.state`` after a step, the largest over the steps;
- ``cuda_max_allocated_bytes``: ``torch.cuda.max_memory_allocated`` of the model's device (CUDA only):
  the peak of everything, activations included.

Storage is counted once per storage (``untyped_storage``), whatever views of it exist. The
backward pass may hold more gradient bytes for a moment (ZeRO-2 frees the full gradient at
the end of backward; docs/SHARDING.md) than the optimizer step sees.
"""
from __future__ import annotations

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)     # a DTensor (FSDP): the shard on this rank
    return to_local() if to_local is not None else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        if t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


class MemoryMeter:
    """Reads a rank's bytes around each step of ``optimizer`` (a step pre- and post-hook); ``as_dict()`` for the record."""

    def __init__(self, module: torch.nn.Module, optimizer):
        self.module, self.optimizer = module, optimizer
        self.parameter_bytes = self.gradient_bytes = self.optimizer_state_bytes = 0
        self.hooks = [optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after)]

    def _stepped(self) -> list:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _before(self, *_):
        params = [*self.module.parameters(), *self._stepped()]
        self.parameter_bytes = max(self.parameter_bytes, storage_bytes(params))
        self.gradient_bytes = max(self.gradient_bytes, storage_bytes([p.grad for p in params]))

    def _after(self, *_):
        tensors = [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        self.optimizer_state_bytes = max(self.optimizer_state_bytes, storage_bytes(tensors))

    def as_dict(self) -> dict:
        out = {"parameter_bytes": self.parameter_bytes, "gradient_bytes": self.gradient_bytes,
               "optimizer_state_bytes": self.optimizer_state_bytes}
        device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        if device.type == "cuda":
            out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        return out

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
