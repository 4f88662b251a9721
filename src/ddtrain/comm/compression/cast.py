"""``fp16`` and ``bf16``: gradients cast to 16 bits for the all-reduce and cast back (Horovod's ``Compression.fp16``).

As PyTorch's ``fp16_compress_hook``/``bf16_compress_hook``: the buffer is cast to the 16-bit
type and divided by the world size *before* the sum (so a float16 sum of R gradients cannot
overflow where their mean would not), summed by the chosen all-reduce, and copied back into
the full-precision buffer. No error feedback: rounding to 16 bits is unbiased enough that the
published recipes (and torch's hooks) use none. Bytes: exactly half of ``none``'s.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddtrain import comm
from ddtrain.comm.compression.volume import allreduce_bytes, numel

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def wire_bytes(shapes, world: int, argument=None, element_size: int = 4) -> float:
    """2(R-1)/R · (elements × 2 bytes): the all-reduce of the 16-bit copy."""
    return allreduce_bytes(sum(numel(s) for s in shapes) * 2, world)


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class Cast:
    """Average a buffer over the group in 16 bits: cast, divide by R, sum, cast back."""

    def __init__(self, name: str):
        self.name, self.dtype = name, DTYPES[name]

    def all_reduce_(self, flat: torch.Tensor, shapes=None, *, algorithm: str = "native", group=None, key=0, keys=None,
                    last: bool = True, timeout_s: float | None = None) -> torch.Tensor:
        compressed = flat.to(self.dtype).div_(group_size(group))
        comm.all_reduce(compressed, algorithm, op="sum", group=group, timeout_s=timeout_s)
        return flat.copy_(compressed)

    def state_dict(self) -> dict:
        """Nothing is kept between steps."""
        return {}

    def load_state_dict(self, state: dict, shapes: dict | None = None) -> None:
        """Nothing to take back."""
