"""Reduction operators, the dtypes each allows, and the wrapper every all-reduce algorithm shares.

An algorithm module supplies only its core, ``core(flat, op, comm) -> None``: reduce the 1-D
contiguous buffer ``flat`` in place with ``op`` in {"sum", "prod", "max", "min"} over
``comm`` (see p2p.Comm), leaving bitwise-identical data on every rank. ``run_all_reduce``
does the rest once for all of them: checks the op against the dtype, returns at once for a
world of one, flattens (complex tensors travel as their real pairs), stages CUDA tensors
through the CPU when the group's backend cannot move them, and turns ``avg`` into ``sum``
followed by a division -- done after the algorithm, on data already identical on every
rank, so the quotient is identical too.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ddtrain.errors import DDTrainError, choice_error
from ddtrain.comm.p2p import Comm, group_info, open_comm

ALL_REDUCE_OPS = ("sum", "avg", "max", "min", "prod")
REDUCE_OPS = ALL_REDUCE_OPS + ("land", "lor", "band", "bor", "maxloc", "minloc")

INTEGER = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
COMPLEX = (torch.complex64, torch.complex128)
SUPPORTED_DTYPES = (torch.bool,) + INTEGER + FLOATING + COMPLEX


def check_op(op: str, dtype: torch.dtype, allowed=ALL_REDUCE_OPS, what: str = "all-reduce") -> None:
    """Raise DDTrainError unless ``op`` is known and meaningful for ``dtype``."""
    if op not in allowed:
        raise choice_error(f"{what} op", op, allowed)
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise DDTrainError(f"{what}: dtype {dtype} is not supported; supported: {names}")
    if dtype in COMPLEX and op not in ("sum", "avg"):
        raise DDTrainError(f"{what}: op {op!r} is not defined for complex dtype {dtype}; use sum or avg")
    if op == "avg" and dtype not in FLOATING + COMPLEX:
        raise DDTrainError(f"{what}: op 'avg' needs a floating-point dtype, got {dtype} "
                           "(reduce with 'sum' and divide as you see fit)")
    if op in ("band", "bor") and dtype not in INTEGER + (torch.bool,):
        raise DDTrainError(f"{what}: bitwise op {op!r} needs an integer or bool dtype, got {dtype}")


def _maximum(acc, x):
    torch.maximum(acc, x, out=acc)


def _minimum(acc, x):
    torch.minimum(acc, x, out=acc)


def _land(acc, x):
    torch.logical_and(acc, x, out=acc)


def _lor(acc, x):
    torch.logical_or(acc, x, out=acc)


def _band(acc, x):
    torch.bitwise_and(acc, x, out=acc)


def _bor(acc, x):
    torch.bitwise_or(acc, x, out=acc)


# acc <- acc (op) x, in place. Every op here is commutative bit for bit (IEEE addition and
# multiplication are), so which operand arrived first never matters; only the bracketing does,
# and each algorithm fixes that by rank, never by arrival time.
COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "sum": torch.Tensor.add_, "avg": torch.Tensor.add_, "prod": torch.Tensor.mul_,
    "max": _maximum, "min": _minimum, "land": _land, "lor": _lor, "band": _band, "bor": _bor,
}


def combine_(op: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    return COMBINE[op]


def _backend_moves(group, device: torch.device) -> bool:
    """Can the group's backend move tensors on ``device``? (Gloo: CPU; NCCL: CUDA.)"""
    backend = str(dist.get_backend(group)).lower()
    if device.type == "cuda":
        return "nccl" in backend or "ucc" in backend
    return "gloo" in backend or "mpi" in backend or "ucc" in backend


def check_device(group, device: torch.device, what: str) -> None:
    """Raise DDTrainError when the group's backend cannot move tensors on ``device``."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1 \
            and not _backend_moves(group, device):
        raise DDTrainError(f"{what}: the {dist.get_backend(group)} backend cannot move {device.type} tensors "
                           f"(Gloo moves CPU tensors, NCCL CUDA tensors)")


def run_all_reduce(tensor: torch.Tensor, op: str, group, timeout_s: float | None, name: str,
                   core: Callable[[torch.Tensor, str, Comm], None]) -> torch.Tensor:
    """Validate, handle world size 1, flatten, stage, call ``core``, finish ``avg``; returns ``tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise DDTrainError(f"{name} all-reduce needs a torch.Tensor, got {type(tensor).__name__}")
    check_op(op, tensor.dtype)
    _, size = group_info(group)
    if size == 1 or tensor.numel() == 0:
        return tensor                     # nothing to exchange; avg over one rank is the identity
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = (torch.view_as_real(work) if work.is_complex() else work).view(-1)
    staged = flat
    if not _backend_moves(group, flat.device):
        if flat.device.type != "cuda":
            raise DDTrainError(f"{name} all-reduce: the {dist.get_backend(group)} backend cannot move "
                               f"{flat.device.type} tensors; move the tensor to the GPU first")
        staged = flat.cpu()               # e.g. CUDA tensors on a Gloo group
    comm = open_comm(name, group, timeout_s, device=staged.device)
    core(staged, "sum" if op == "avg" else op, comm)
    if op == "avg":
        staged.div_(size)
    if staged is not flat:
        flat.copy_(staged)
    if work is not tensor:
        tensor.copy_(work)
    return tensor
