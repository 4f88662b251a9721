"""``fsdp``: PyTorch's own FSDP2 (``fully_shard``): parameters, gradients and optimizer state split over the ranks.

Not a copy: ``torch.distributed.fsdp.fully_shard`` (torch >= 2.6; ``torch.distributed._composable.fsdp``
on 2.4/2.5) shards every parameter along dim 0 as a DTensor, all-gathers a unit's parameters
before its forward and backward and reduce-scatters its gradients after (FSDP's 1.5x an
all-reduce's bytes: two all-gathers and a reduce-scatter). It runs on Gloo: torch 2.13's Gloo
has all the collectives FSDP2 calls (``all_gather_into_tensor``, ``reduce_scatter_tensor``) --
checked on 3 CPU ranks, tests/sync/test_zero.py::test_fsdp_equals_ddp_and_plain_loop.

Wrapping policy (``units``): consecutive modules grouped into the fewest units of at most
``MAX_UNIT_PARAMS`` parameters each (``fully_shard`` of a list: one all-gather and one
reduce-scatter per group), the root last. Every unit costs its hooks, copies and collectives on
every step whatever its size, and saves the memory of its parameters only while another unit runs.
From the root down, siblings are added to the current unit while it stays under the bound; a child
larger than the bound is split into its children, except a block (class name ending in ``Block``
or ``Layer``: a residual or transformer block) or a leaf, which is a unit of its own at any size.
The model's ``fsdp_units`` attribute (a tuple of classes) overrides all this: a unit per module of
those classes. (torch 2.4/2.5's ``fully_shard`` takes one module: a group is then a unit per module.)

The user's optimizer is kept: ``fully_shard`` replaces the model's parameters by DTensor ones,
and the optimizer's param groups (and any state) are moved onto them by name. Mixed precision:
``--fsdp-param-dtype bf16|fp16`` is FSDP's ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)``.

Channels-last: FSDP2 refuses parameters whose storage is not contiguous, so a channels-last model's
convolution weights are made contiguous before ``fully_shard``; the inputs stay channels-last, and a
convolution with a channels-last input computes channels-last (torch picks the layout from either).

State dicts are the whole model's, as ddp's (world-size independent): the model's
``state_dict()`` and the optimizer's gather their DTensors to full tensors (collective: every rank
calls them; the spec says ``sharded``), and their ``load_state_dict`` cut full tensors to this
rank's shard. After training (``close``) the model's full state is kept, so rank 0 alone may save it.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ddtrain.errors import DDTrainError
from ddtrain.sync.base import Strategy, SyncOptions

PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _fsdp():
    """(fully_shard, MixedPrecisionPolicy) of this torch."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard   # torch >= 2.6
    except ImportError:   # torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


# The largest unit gathered whole: 2**24 parameters (64 MiB in fp32). What a small model pays is the
# count of units, not their size: a unit per ResNet-50 block (16 + the root) ran the compiled bf16 path on
# one H200 at 0.393x ddp's images/s (results/sharding/gpu_h200.json); on this project's 2-core CPU
# each FSDP2 unit adds 0.57 ms to a step, its size aside (81 one-layer units: 55.3 ms, one: 9.5 ms;
# median of 3, results/sharding/fsdp_unit_cost_cpu.json). At this bound ResNet-50 is 2 units, VGG-16 4.
MAX_UNIT_PARAMS = 1 << 24


def _size(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _is_block(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith(("Block", "Layer"))


def units(model: torch.nn.Module, max_params: int | None = None) -> list[list[torch.nn.Module]]:
    """The units sharded before the root, in forward order: each a list of modules gathered as one (see the module doc)."""
    wanted = getattr(model, "fsdp_units", None)
    if wanted:
        picked = []
        for module in model.modules():
            if module is not model and isinstance(module, tuple(wanted)) and \
                    not any(module in {*m.modules()} for group in picked for m in group):
                picked.append([module])
        return picked
    limit = max_params or MAX_UNIT_PARAMS
    found: list[list[torch.nn.Module]] = []

    def walk(module) -> None:
        group, size = [], 0
        for child in module.children():
            n = _size(child)
            if not n:
                continue
            if n > limit and any(True for _ in child.children()) and not _is_block(child):
                found.extend([group] if group else [])
                group, size = [], 0
                walk(child)                 # too large to gather whole: its children
            elif group and size + n > limit:
                found.append(group)
                group, size = [child], n
            else:
                group, size = [*group, child], size + n
        found.extend([group] if group else [])
    walk(model)
    return found


def _shard_group(fully_shard, group: list, policy) -> int:
    """``fully_shard`` a unit: a list of modules as one (torch >= 2.6), each on its own where a list is refused;
    the FSDP units made (each gathers and reduce-scatters on its own)."""
    if len(group) == 1:
        fully_shard(group[0], mp_policy=policy)
        return 1
    try:
        fully_shard(group, mp_policy=policy)
        return 1
    except (TypeError, AttributeError, ValueError, AssertionError):   # torch 2.4/2.5: one module at a time
        for module in group:
            fully_shard(module, mp_policy=policy)
        return len(group)


def _distribute(full: torch.Tensor, like) -> torch.Tensor:
    """``full`` (the same on every rank) cut like DTensor ``like``: each rank keeps its shard, nothing is sent."""
    try:
        from torch.distributed.tensor import distribute_tensor
    except ImportError:   # torch 2.4
        from torch.distributed._tensor import distribute_tensor
    try:
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    except TypeError:     # an older torch without src_data_rank: rank 0's copy is scattered (the same values)
        return distribute_tensor(full, like.device_mesh, like.placements)


def _is_dtensor(t) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "device_mesh")


class FSDPStrategy(Strategy):
    """``fsdp`` on this rank: the model sharded in place by ``fully_shard``, the optimizer moved onto its DTensors."""

    def __init__(self, model, optimizer, options: SyncOptions):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise DDTrainError(f"fsdp: needs one torch.optim.Optimizer over the model's parameters, got "
                               f"{type(optimizer).__name__}")
        fully_shard, MixedPrecisionPolicy = _fsdp()
        names = {id(p): name for name, p in model.named_parameters()}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if any(id(p) not in names for p in held):
            raise DDTrainError("fsdp: the optimizer holds parameters that are not the model's")
        scalar = [name for name, p in model.named_parameters() if p.dim() == 0]
        if scalar:
            raise DDTrainError(f"fsdp: parameter {scalar[0]!r} is a scalar (0-d): FSDP shards parameters along dim 0; "
                               "make it a 1-element tensor, or use zero1/zero2")
        # FSDP2 shards a parameter's storage along dim 0 and refuses any other layout ("FSDP does not support
        # non-contiguous parameters yet"): channels-last convolution weights (--channels-last) are made
        # contiguous again; the convolutions still run channels-last, chosen from their channels-last inputs
        relaid = [p for p in model.parameters() if not p.is_contiguous()]
        with torch.no_grad():
            for p in relaid:
                p.data = p.data.contiguous()
        policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[options.fsdp_param_dtype], reduce_dtype=torch.float32)
        self.units = units(model)
        try:
            made = sum(_shard_group(fully_shard, unit, policy) for unit in self.units)
            fully_shard(model, mp_policy=policy)
        except (RuntimeError, ValueError, AssertionError) as exc:
            raise DDTrainError(f"fsdp: fully_shard refused the model: {str(exc).splitlines()[0][:300]}") from None
        new = dict(model.named_parameters())
        moved = {id(p): new[names[id(p)]] for p in held}
        for group in optimizer.param_groups:
            group["params"] = [moved[id(p)] for p in group["params"]]
            if group.get("fused"):
                # DTensor has no sharding rule for the fused optimizer kernels ("aten._fused_sgd_.default does not
                # have a sharding strategy registered": torch 2.11 on one H200, results/sharding/gpu_h200_fused_sgd.log,
                # and torch 2.13's CPU kernel): the for-each kernels, which DTensor shards, do the same arithmetic
                group["fused"], group["foreach"] = False, True
        if optimizer.defaults.get("fused"):
            optimizer.defaults["fused"] = False
        for old_id, param in moved.items():   # state loaded before wrapping: keyed by the old parameter objects
            for key in [k for k in optimizer.state if id(k) == old_id]:
                optimizer.state[param] = optimizer.state.pop(key)
        super().__init__(model, optimizer, module=model)
        self.final_state: dict | None = None
        # (torch marks public state-dict hooks with an attribute, which a bound method cannot take: lambdas)
        self.hooks = [model.register_state_dict_post_hook(lambda *args: self._full_model_state(*args)),
                      model.register_load_state_dict_pre_hook(lambda *args: self._shard_model_state(*args)),
                      optimizer.register_state_dict_post_hook(self._full_optimizer_state),
                      optimizer.register_load_state_dict_pre_hook(self._shard_optimizer_state)]
        self.stats.method = ("formula: FSDP2's collectives run inside torch; per training forward and its backward (R-1)/R "
                             "of twice the units' parameters and once the root's own (all-gathers in the gather "
                             "dtype) and of every parameter in fp32 (the reduce-scatter)")
        ranks = dist.get_world_size()
        gather_size = torch.tensor([], dtype=PARAM_DTYPES[options.fsdp_param_dtype] or torch.float32).element_size()
        in_units = sum(_size(m) for unit in self.units for m in unit)
        total = sum(p.numel() for p in model.parameters())
        share = (ranks - 1) / ranks
        # the root is not resharded after forward (FSDP2's heuristic: its backward would gather it at once)
        # every training forward is followed by a backward that reduce-scatters (no_sync included: see there)
        self.forward_bytes = int(share * gather_size * (2 * in_units + (total - in_units)) + share * 4 * total)
        self.forward_messages = (ranks - 1) * (3 * made + 2)
        self.hooks.append(model.register_forward_pre_hook(lambda *_: self._count_forward()))
        self.stats.extra["fsdp_units"] = made + 1
        if relaid:
            self.stats.extra["fsdp_made_contiguous"] = len(relaid)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulation: every micro-batch's gradient is reduce-scattered and added to the shard (as DeepSpeed does).

        The sum of the micro-batches' averaged shards is the average of their summed gradients, so
        k micro-batches still take the step of one batch k times larger; the whole unsharded gradient
        is never kept between micro-batches (FSDP's point), at the price of a reduce-scatter per
        micro-batch. FSDP's own switch, ``set_requires_gradient_sync(False)``, keeps unsharded
        gradients instead, and in torch 2.13 fails in its post-backward (``'FSDPParam' object has no
        attribute '_unsharded_param'``) for a unit that took no part in the forward (an unused head).
        """
        self.accumulating += 1
        try:
            yield
        finally:
            self.accumulating -= 1

    def _count_forward(self) -> None:
        if self.module.training and torch.is_grad_enabled():
            self._add(self.forward_bytes, self.forward_messages)

    def _add(self, nbytes: int, messages: int) -> None:
        stats = self.stats
        stats.bytes_sent += nbytes
        stats.bytes_received += nbytes
        stats.messages_sent += messages
        stats.messages_received += messages

    def replicas_identical(self, step: int) -> bool:
        return False        # each rank holds other shards: nothing to compare (the DTensors are one tensor)

    # ---- state dicts in the whole model's layout -----------------------------------------------
    def _full_model_state(self, module, state_dict, prefix, local_metadata):
        if self.final_state is not None:      # after training: rank 0 saves alone
            state_dict.update({k: v for k, v in self.final_state.items() if k in state_dict})
            return
        for key, value in list(state_dict.items()):
            if _is_dtensor(value):
                state_dict[key] = value.full_tensor()

    def _shard_model_state(self, module, state_dict, prefix, *args):
        params = dict(module.named_parameters())
        for name, param in params.items():
            key = prefix + name
            if key in state_dict and not _is_dtensor(state_dict[key]) and _is_dtensor(param):
                full = state_dict[key].to(param.device, param.dtype)
                state_dict[key] = _distribute(full, param)

    def _params(self) -> list:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _full_optimizer_state(self, optimizer, state_dict: dict) -> dict:
        # new dicts: torch's state_dict() hands out the optimizer's own per-parameter dicts
        state = {index: {key: value.full_tensor() if _is_dtensor(value) else value for key, value in values.items()}
                 for index, values in state_dict["state"].items()}
        return {**state_dict, "state": state}

    def _shard_optimizer_state(self, optimizer, state_dict: dict) -> dict:
        params = self._params()
        state = {}
        for index, values in state_dict.get("state", {}).items():
            param = params[int(index)]
            state[index] = {key: _distribute(value.to(param.device), param)
                            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0
                            else value for key, value in values.items()}
        return {**state_dict, "state": state}

    def close(self) -> None:
        """Keep the model's full state (a collective, every rank is here): rank 0 saves it alone afterwards."""
        if dist.is_initialized():
            self.final_state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}


def build_fsdp(model, optimizer, options: SyncOptions) -> FSDPStrategy:
    return FSDPStrategy(model, optimizer, options)
