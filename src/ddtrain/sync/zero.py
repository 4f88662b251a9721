"""``zero1``, ``zero2``: data parallelism with the optimizer state (ZeRO-1) and the gradients too (ZeRO-2) split.

ZeRO (Rajbhandari et al. 2020) is ddp with the replicated state divided among the R ranks. The
trainable parameters are laid out, group by group of the optimizer, in one flat buffer of N
elements cut into R shards (``ddtrain.comm.shards``: ``ceil(N/R)`` elements each, the last shorter).
The user's optimizer object is kept (schedulers, clipping hooks and checkpoints hold it) but its
param groups now hold this rank's piece of each group instead of the model's parameters, so it
keeps state (AdamW's ``exp_avg``, SGD's ``momentum_buffer``) for N/R elements only. Each step:

1. end of backward (one autograd callback, queued by the first gradient of the pass; skipped
   inside ``no_sync()``): the gradients are flattened; ZeRO-1 all-reduces them (every rank keeps
   the averaged gradient, as ddp: the model's ``.grad`` are views of it); ZeRO-2 frees the
   model's ``.grad`` and reduce-scatters, keeping the averaged gradient of its own shard only;
2. ``optimizer.step()``: the user's optimizer steps its shard (a copy of the model's values
   taken at the step, so a ``load_state_dict`` of the model is never undone);
3. a step post-hook all-gathers the parameters into the model: every replica ends bitwise the
   same (the spec says ``replicated``; the replica check verifies it).

Communication goes over ``--shard-algorithm`` (``comm.shards``): ZeRO-2 moves what one
all-reduce moves (a reduce-scatter plus an all-gather), ZeRO-1 an all-reduce plus an all-gather.

Arithmetic: every element is updated by exactly the optimizer step ddp's would apply to it (torch's
optimizers are elementwise), on the gradient averaged by another bracketing of the same sum
(sum then divide, where DDP divides then sums), so parameters agree with ddp's to rounding
(docs/SHARDING.md: within 1e-5 relative after 40 steps, tests/sync/test_zero.py).

Optimizers: any whose per-parameter state is elementwise (every torch.optim class but those in
``NOT_SPLITTABLE``, whose state or update depends on the whole tensor's shape). Checkpoints and
``optimizer.state_dict()`` (collective under ZeRO: every rank calls it) are in the layout of the
optimizer over the whole model, as ddp's -- a state dict of any world size, or of ddp, loads.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddtrain.comm import shards
from ddtrain.errors import DDTrainError
from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import Strategy, SyncOptions
from ddtrain.sync.buffers import BufferRule
from ddtrain.sync.divergence import DivergenceMonitor

# torch optimizers whose state is not elementwise: a shard of a parameter cannot be stepped alone
NOT_SPLITTABLE = {
    "LBFGS": "keeps one history of flattened whole-model vectors and runs its own closure loop",
    "Adafactor": "keeps row and column statistics of each whole matrix (factored second moments)",
    "SparseAdam": "steps sparse gradients, which a flat dense shard cannot hold",
    "Muon": "orthogonalises each whole weight matrix (Newton-Schulz on its 2-D shape)",
    "Shampoo": "keeps preconditioners of each whole tensor's dimensions",
}


def check_optimizer(optimizer) -> None:
    """DDTrainError naming the optimizer when ZeRO cannot split its state (its class or a base is in NOT_SPLITTABLE)."""
    if isinstance(optimizer, (list, tuple)) or not isinstance(optimizer, torch.optim.Optimizer):
        raise DDTrainError("zero1/zero2: needs one torch.optim.Optimizer over the model's parameters, got "
                           f"{type(optimizer).__name__}")
    for cls in type(optimizer).__mro__:
        if cls.__name__ in NOT_SPLITTABLE:
            raise DDTrainError(f"zero1/zero2 cannot split optimizer {type(optimizer).__name__}: it "
                               f"{NOT_SPLITTABLE[cls.__name__]}; use an elementwise optimizer (SGD, Adam, AdamW, "
                               "RMSprop, ...) or strategy ddp or fsdp")


class FlatLayout:
    """The trainable parameters, optimizer group by group, as one flat buffer of ``numel`` elements cut into shards."""

    def __init__(self, model: torch.nn.Module, optimizer, rank: int, size: int, algorithm: str):
        trainable = [p for p in model.parameters() if p.requires_grad]
        seen, self.params, self.group_ranges, self.members = set(), [], [], []
        for index, group in enumerate(optimizer.param_groups):
            lo = sum(p.numel() for p in self.params)
            # the index of each parameter in the whole model's optimizer state dict (torch numbers them in this order)
            self.members.append(list(range(len(self.params), len(self.params) + len(group["params"]))))
            for p in group["params"]:
                if id(p) in seen:
                    raise DDTrainError(f"zero: a parameter of shape {tuple(p.shape)} is in two optimizer param groups "
                                       f"(group {index} again); each parameter must be in exactly one")
                seen.add(id(p))
                self.params.append(p)
            self.group_ranges.append((lo, lo + sum(p.numel() for p in group["params"])))
        self._check(trainable, seen)
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel, self.dtype, self.device = self.offsets[-1], self.params[0].dtype, self.params[0].device
        self.size = size
        self.bounds = shards.shard_bounds(self.numel, size)
        self.shard = owned = shards.owned_shard(algorithm, rank, size)
        self.lo, self.hi = self.bounds[owned], self.bounds[owned + 1]

    def _check(self, trainable, in_optimizer) -> None:
        """One message for a model whose parameters one flat buffer cannot hold (the policy's refusal)."""
        if not self.params:
            raise DDTrainError("zero: the optimizer holds no parameters to shard")
        model_ids = {id(p) for p in trainable}
        missing = [p for p in trainable if id(p) not in in_optimizer]
        if missing:
            raise DDTrainError(f"zero: {len(missing)} trainable parameter(s) of the model (the first of shape "
                               f"{tuple(missing[0].shape)}) are in no optimizer param group; ZeRO shards what the "
                               "optimizer steps: add them, or set requires_grad=False")
        if any(id(p) not in model_ids for p in self.params):
            raise DDTrainError("zero: the optimizer holds parameters that are not trainable parameters of the model")
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise DDTrainError(f"zero: the parameters cannot share one flat buffer: they have {len(kinds)} "
                               f"(dtype, device) kinds ({', '.join(sorted(f'{d} on {v}' for d, v in kinds))}); "
                               "cast the model to one dtype on one device (mixed precision: --amp)")
        if any(p.is_sparse or not p.is_floating_point() for p in self.params):
            raise DDTrainError("zero: sparse or non-floating-point parameters cannot be sharded")

    def group_piece(self, index: int) -> tuple[int, int]:
        """The part of group ``index``'s range inside this rank's shard, as flat offsets (lo == hi: none)."""
        glo, ghi = self.group_ranges[index]
        lo, hi = max(glo, self.lo), min(ghi, self.hi)
        return (lo, hi) if lo < hi else (self.lo, self.lo)

    def flatten(self, tensors) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into tensors of each parameter's shape (views)."""
        return [flat[a:b].view_as(p) for p, a, b in zip(self.params, self.offsets, self.offsets[1:])]


class ZeroStrategy(Strategy):
    """``zero1`` (stage 1) or ``zero2`` (stage 2) applied to this rank's model and optimizer (see the module doc)."""

    def __init__(self, model, optimizer, options: SyncOptions, *, stage: int):
        check_optimizer(optimizer)
        rank, size = dist.get_rank(), dist.get_world_size()
        self.stage, self.algorithm = stage, options.shard_algorithm
        self.layout = layout = FlatLayout(model, optimizer, rank, size, self.algorithm)
        super().__init__(model, optimizer, module=model)
        self.ledger = Ledger(shards.operations(self.algorithm))
        self.monitor = DivergenceMonitor(model, self.stats, None, options.check_every)
        self.buffers = BufferRule(model, None, options.broadcast_buffers)
        self.shard_grads: list[torch.Tensor | None] = [None] * len(optimizer.param_groups)
        self._queued = False
        self.unused: list[tuple[int, int]] = []   # flat ranges of the parameters no rank had a gradient for
        self._kept: list = []
        self._full_state = optimizer.state_dict() if optimizer.state else None   # state loaded before wrapping
        # the optimizer now steps this rank's piece of each group: one tensor per group, refreshed from the model
        self.pieces = [torch.zeros(hi - lo, dtype=layout.dtype, device=layout.device)
                       for lo, hi in (layout.group_piece(i) for i in range(len(optimizer.param_groups)))]
        for group, piece in zip(optimizer.param_groups, self.pieces):
            group["params"] = [piece]
        optimizer.state.clear()
        self.hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready) for p in layout.params]
        self.hooks += [model.register_forward_pre_hook(lambda *_: self.buffers.before_forward()),
                       model.register_forward_hook(lambda *_: self.buffers.after_forward(
                           torch.is_grad_enabled() and self.require_backward_grad_sync)),
                       optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(self._after_step),
                       optimizer.register_state_dict_post_hook(self._full_state_dict),
                       optimizer.register_load_state_dict_pre_hook(self._shard_state_dict)]
        # recipe.clip_gradients reads this: the norm over every rank's shard, not this rank's alone
        optimizer.ddtrain_total_grad_norm = self.total_grad_norm
        optimizer.clip_grad_norm_ = self.clip_grad_norm_
        # the optimizer's own zero_grad sees only the pieces: the model's gradients (zero1's views of the averaged
        # buffer, or what accumulates before the reduction) go too, or a step skipped after zero_grad would add
        # them to the next backward's
        own_zero_grad = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            own_zero_grad(set_to_none)
            self.shard_grads = [None] * len(self.pieces)
            for p in layout.params:
                p.grad = None

        optimizer.zero_grad = zero_grad
        if self._full_state is not None:
            optimizer.load_state_dict(self._full_state)

    # ---- gradients --------------------------------------------------------------------------
    def _gradient_ready(self, _param) -> None:
        if self._queued or not self.require_backward_grad_sync:
            return    # inside no_sync(): the gradients stay on this rank, summed, until the last micro-batch
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._reduce_gradients)

    def _reduce_gradients(self) -> None:
        """End of backward: average the gradients (ZeRO-1: all of them; ZeRO-2: this rank's shard only)."""
        self._queued = False
        layout = self.layout
        # a parameter no rank has a gradient for (an unused head) is left alone by ddp's optimizer step (its .grad
        # is None): remember which, so that the shard step leaves those elements and their state as they were
        used = [p.grad is not None for p in layout.params]
        if layout.size > 1:   # (one rank: nothing to ask, and no device sync for the answer)
            flags = torch.tensor(used, dtype=torch.int32, device=layout.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)   # len(params) ints: torch's own, measurement-sized
            used = flags.tolist()
        self.unused = [(a, b) for (a, b), u in zip(zip(layout.offsets, layout.offsets[1:]), used) if not u and a < b]
        with self.ledger.timed():
            flat = layout.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in layout.params])
            if self.stage == 1:
                from ddtrain import comm
                comm.all_reduce(flat, self.algorithm, op="avg")
                for p, view in zip(layout.params, layout.views(flat)):
                    p.grad = view          # the model's gradients are the averaged buffer, as ddp leaves them
                mine, base = flat, 0
            else:
                for p in layout.params:
                    p.grad = None          # the full gradient lives only in ``flat`` until the reduce-scatter ends
                mine, base = shards.reduce_scatter_(flat, self.algorithm).div_(layout.size), layout.lo
                del flat
        # the pieces get their gradients now, not at the step: a GradScaler unscales (and checks) the optimizer's
        # gradients before it calls step(), and clipping between backward and step sees them
        for index, (lo, hi) in enumerate(layout.group_piece(i) for i in range(len(self.pieces))):
            self.shard_grads[index] = mine[lo - base:hi - base]
            self.pieces[index].grad = self.shard_grads[index].view_as(self.pieces[index])

    def total_grad_norm(self, grads=None) -> torch.Tensor:
        """The 2-norm of the whole averaged gradient: each rank's shard's sum of squares, summed over ranks."""
        mine = [g for g in self.shard_grads if g is not None]
        local = sum((g.double().square().sum() for g in mine), torch.zeros((), dtype=torch.float64,
                                                                            device=self.layout.device))
        total = local.reshape(1).clone()
        dist.all_reduce(total)       # 8 bytes: measurement-sized, torch's own
        return total.sqrt()[0].to(self.layout.dtype)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model's gradient, for scripts (ZeRO-2 keeps no ``.grad``)."""
        norm = self.total_grad_norm()
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in self.shard_grads:
            if g is not None:
                g.mul_(scale)
        return norm

    # ---- the step ---------------------------------------------------------------------------
    def _before_step(self, optimizer, _args, _kwargs) -> None:
        layout = self.layout
        values = layout.flatten([p.detach() for p in layout.params]) if layout.numel else None
        for index, piece in enumerate(self.pieces):
            lo, hi = layout.group_piece(index)
            piece.copy_(values[lo:hi])
        self._save_frozen(optimizer)

    def _frozen(self):
        """(piece index, start, end) of the elements of parameters no rank had a gradient for, in this rank's pieces."""
        layout = self.layout
        for index in range(len(self.pieces)):
            lo, hi = layout.group_piece(index)
            for a, b in self.unused:
                start, end = max(a, lo), min(b, hi)
                if start < end:
                    yield index, start - lo, end - lo

    def _save_frozen(self, optimizer) -> None:
        self._kept = [(i, a, b, self.pieces[i][a:b].clone(),
                       {k: v[a:b].clone() for k, v in optimizer.state.get(self.pieces[i], {}).items()
                        if isinstance(v, torch.Tensor) and v.shape == self.pieces[i].shape})
                      for i, a, b in self._frozen()]

    def _restore_frozen(self, optimizer) -> None:
        with torch.no_grad():
            for i, a, b, values, state in self._kept:
                self.pieces[i][a:b].copy_(values)
                for key, value in optimizer.state.get(self.pieces[i], {}).items():
                    if isinstance(value, torch.Tensor) and value.shape == self.pieces[i].shape:
                        value[a:b].copy_(state[key]) if key in state else value[a:b].zero_()
        self._kept = []

    def _after_step(self, optimizer, _args, _kwargs) -> None:
        layout = self.layout
        self._restore_frozen(optimizer)
        flat = torch.empty(layout.numel, dtype=layout.dtype, device=layout.device)
        for index, piece in enumerate(self.pieces):
            lo, hi = layout.group_piece(index)
            flat[lo:hi].copy_(piece.detach())
        with self.ledger.timed(), torch.no_grad():
            shards.all_gather_(flat, self.algorithm)
            for p, view in zip(layout.params, layout.views(flat)):
                p.copy_(view)
        # the gradients are spent: the next backward starts afresh (the optimizer's zero_grad sees only the pieces)
        self.shard_grads = [None] * len(self.pieces)
        for p in (*layout.params, *self.pieces):
            p.grad = None

    # ---- the optimizer's state, in the whole model's layout ------------------------------------
    def _full_state_dict(self, optimizer, local: dict) -> dict:
        """Collective: the shard state dict made into the one of the optimizer over the whole model (every rank)."""
        layout = self.layout
        pieces = local["state"]            # group index -> its piece's state
        groups = [{**group, "params": layout.members[g]} for g, group in enumerate(local["param_groups"])]
        # elementwise entries (AdamW's exp_avg, SGD's momentum_buffer) have the piece's shape; the rest (AdamW's
        # step) are the same on every rank
        keys = sorted({k for g, values in pieces.items() for k, v in values.items()
                       if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == self.pieces[g].shape})
        state: dict = {i: {} for i in range(len(layout.params))}
        for key in keys:     # the same keys on every rank: every rank has stepped every group (empty pieces too)
            dtype = next(values[key].dtype for values in pieces.values() if key in values)
            flat = torch.zeros(layout.numel, dtype=dtype, device=layout.device)
            for g, values in pieces.items():
                if key in values:
                    lo, hi = layout.group_piece(g)
                    flat[lo:hi].copy_(values[key])
            views = layout.views(shards.all_gather_(flat, self.algorithm))
            for g, values in pieces.items():
                for i in layout.members[g] if key in values else ():
                    state[i][key] = views[i].clone()
        for g, values in pieces.items():
            for key, value in values.items():
                for i in layout.members[g] if key not in keys else ():
                    state[i][key] = value.clone() if isinstance(value, torch.Tensor) else value
        return {"state": {i: s for i, s in state.items() if s}, "param_groups": groups}

    def _shard_state_dict(self, optimizer, full: dict) -> dict:
        """A state dict over the whole model (any world size, or ddp's) cut to this rank's pieces."""
        layout = self.layout
        groups = full.get("param_groups", [])
        if [len(g["params"]) for g in groups] != [len(m) for m in layout.members]:
            raise ValueError(f"the optimizer state dict's param groups hold {[len(g['params']) for g in groups]} "
                             f"parameters, this optimizer's {[len(m) for m in layout.members]} (ZeRO loads the layout "
                             "of the optimizer over the whole model)")
        saved, state = full.get("state", {}), {}
        for g, group in enumerate(groups):
            kept = [saved.get(i, {}) for i in group["params"]]
            if not any(kept):
                continue
            (lo, hi), glo = layout.group_piece(g), layout.group_ranges[g][0]
            values = {}
            for key, value in next(s for s in kept if s).items():
                elementwise = all(isinstance(s.get(key), torch.Tensor) and s[key].dim() > 0
                                  and s[key].numel() == layout.params[i].numel() for s, i in zip(kept, layout.members[g]))
                if elementwise:
                    whole = torch.cat([s[key].reshape(-1).to(layout.device) for s in kept])
                    values[key] = whole[lo - glo:hi - glo].clone()
                else:
                    values[key] = value
            state[g] = values
        return {"state": state, "param_groups": [{**group, "params": [g]} for g, group in enumerate(groups)]}

    # ---- accounting -------------------------------------------------------------------------
    def update_stats(self) -> None:
        self.ledger.fill(self.stats)
        self.stats.extra["shard_elements"] = self.layout.hi - self.layout.lo
        self.stats.extra["comm_wait_note"] = "time inside the gradient reduction and the parameter all-gather"

    def close(self) -> None:
        """Nothing: the optimizer stays sharded after training (its state_dict() still gathers the whole layout)."""


def build_zero(model, optimizer, options: SyncOptions, *, stage: int) -> ZeroStrategy:
    return ZeroStrategy(model, optimizer, options, stage=stage)

