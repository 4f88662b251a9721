"""Non-finite losses and gradients: stop naming step and rank, or skip the step on every rank alike.

``NonfiniteGuard.check_loss`` runs before backward (in stop mode a non-finite loss ends the run
on the rank that saw it); ``step_ok`` after backward says whether to apply the step. With
``on_nonfinite="skip"`` the ranks agree through one all-reduce of a flag per rank and all skip
the step together (a rank skipping alone would leave the replicas apart).

Skipping is bounded: ``MAX_CONSECUTIVE_SKIPS`` skipped steps in a row stop the run (a model
whose every step is non-finite is not recovering, and skipping only hides it), and
``finish`` refuses to call a run a success when more than ``MAX_SKIPPED_FRACTION`` of its steps
were skipped or its last epoch's loss is non-finite (checked only every 50 steps on a GPU in stop
mode, so a divergence between checks is caught there).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ddtrain.distributed import runtime
from ddtrain.errors import DDTrainError
from ddtrain.reliability import stall
from ddtrain.reliability.consistency import PeerStopped

MAX_CONSECUTIVE_SKIPS = 10     # skipped steps in a row that stop a run (on_nonfinite="skip")
MAX_SKIPPED_FRACTION = 0.5     # a run that skipped more of its steps than this did not train
HINT = ("lower the learning rate (lr, --lr), check the data, or resume from an earlier checkpoint with a lower one "
        "(--resume --lr ...)")


def grads_finite(module) -> bool:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm(grads)
    return bool(torch.isfinite(torch.stack(norms)).all().item())


def agree_on_bad(loss_bad: bool, grads_bad: bool, device, group=None) -> tuple[list[int], str]:
    """Collective: (global ranks to blame, "loss" or "gradients"), the same on every rank; ([], "") if none.

    Gradients that went through an all-reduce are non-finite everywhere once they are on one
    rank, so the ranks whose loss was non-finite are named first.
    """
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        me = dist.get_rank() if dist.is_initialized() else 0
        return ([me], "loss") if loss_bad else ([me], "gradients") if grads_bad else ([], "")
    flags = torch.zeros(2, dist.get_world_size(group), dtype=torch.int32, device=device)
    flags[0, dist.get_rank(group)], flags[1, dist.get_rank(group)] = int(loss_bad), int(grads_bad)
    dist.all_reduce(flags, group=group)
    for row, cause in ((0, "loss"), (1, "gradients")):
        ranks = [r for r, f in enumerate(flags[row].tolist()) if f]
        if ranks:
            return [dist.get_global_rank(group, r) if group is not None else r for r in ranks], cause
    return [], ""


class NonfiniteGuard:
    """The loop's non-finite checks: ``check_loss(loss, step)`` before backward, ``step_ok(step)`` after."""

    def __init__(self, on_nonfinite: str, *, module, scaler, device, group, info: dict):
        self.skip = on_nonfinite == "skip"
        self.module, self.scaler, self.device, self.group, self.info = module, scaler, device, group, info
        self.every_step = self.skip or device.type != "cuda"
        self._loss_bad = False
        self.consecutive = 0          # skipped steps in a row, up to the last checked one

    def _checking(self, step: int) -> bool:
        # On a GPU each check is a host sync: every step only when skipping needs it.
        return self.every_step or step % 50 == 0

    def check_loss(self, loss, step: int) -> None:
        """Before backward: in stop mode a non-finite loss ends the run naming this rank."""
        self._loss_bad = self._checking(step) and not bool(torch.isfinite(loss.detach()).all().item())
        if self._loss_bad and not self.skip:
            raise DDTrainError(f"non-finite loss ({loss.item()}) on rank {runtime.rank()} at step {step}; lower the "
                               "learning rate (lr, --lr), check the data, or pass on_nonfinite='skip' "
                               "(--on-nonfinite skip)")

    def step_ok(self, step: int) -> bool:
        """After backward: False when this step must be skipped (on every rank alike)."""
        stall.mark(step, "optimizer step")
        if not self._checking(step):
            return True
        grads_bad = self.scaler is None and not grads_finite(self.module)
        if not self.skip:
            if grads_bad:
                raise DDTrainError(f"non-finite gradients on rank {runtime.rank()} at step {step} (the loss was "
                                   "finite here; after an all-reduce every rank sees them); lower the learning "
                                   "rate (lr, --lr) or pass on_nonfinite='skip' (--on-nonfinite skip)")
            return True
        stall.mark(step, "non-finite agreement (all-reduce of one flag per rank)")
        ranks, cause = agree_on_bad(self._loss_bad, grads_bad, self.device, self.group)
        stall.mark(step, "optimizer step")
        if not ranks:
            self.consecutive = 0
            return True
        skipped = self.info["nonfinite_skipped"]
        skipped.append({"step": step, "ranks": ranks, "cause": cause})
        self.consecutive += 1
        if self.consecutive >= MAX_CONSECUTIVE_SKIPS:   # the same verdict on every rank: all ranks agreed above
            first = step - self.consecutive + 1
            raise (DDTrainError if runtime.rank() == 0 else PeerStopped)(
                f"non-finite {cause} at {self.consecutive} steps in a row (steps {first} to {step}, each skipped on "
                f"every rank by on_nonfinite='skip', --on-nonfinite skip; {len(skipped)} skipped in all): training "
                f"is not recovering, stopped; {HINT}")
        if runtime.rank() == 0:
            runtime.eprint(f"ddtrain: warning: non-finite {cause} at step {step} on rank "
                           f"{', '.join(map(str, ranks))}; step skipped on every rank ({len(skipped)} so far)")
        return False

    def finish(self, steps: int, last_epoch: dict | None) -> str | None:
        """After training: why the run must not count as a success (``steps`` trained in this process), or None.

        The record says it (``reliability.nonfinite_failed``), with the count of skipped steps
        (``reliability.nonfinite_skipped_steps``).
        """
        skipped = len(self.info["nonfinite_skipped"])
        self.info["nonfinite_skipped_steps"] = skipped
        why = None
        if steps and skipped > MAX_SKIPPED_FRACTION * steps:
            why = (f"{skipped} of its {steps} steps had a non-finite loss or gradients and were skipped "
                   f"(on_nonfinite='skip', --on-nonfinite skip): the model did not train; {HINT}")
        else:
            bad = [f"{name} {last_epoch[name]}" for name in ("train_loss", "val_loss")
                   if isinstance((last_epoch or {}).get(name), float) and not math.isfinite(last_epoch[name])]
            if bad:
                why = f"the last epoch's {' and '.join(bad)} is not finite: the model diverged; {HINT}"
        if why:
            self.info["nonfinite_failed"] = why
        return why
