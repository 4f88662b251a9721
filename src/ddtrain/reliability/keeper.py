"""The training loop's reliability hooks in one object: resume, checkpoints, replica checks, non-finite steps.

``fit`` makes one ``Keeper`` and the loop calls it at fixed points (``begin_epoch``,
``batches``, ``begin_step``, ``check_loss``, ``step_ok``, ``after_step``) so that train.py
stays a plain loop. Everything it decides is the same on every rank (checkpoint and check
steps are functions of the step; skipping a step is agreed by an all-reduce).

Resuming is step-for-step exact: the checkpoint holds the state after step S together with
the RNG states at the start of S's epoch and after S. On resume the loop re-enters that
epoch, sets the epoch-start RNG state, draws and discards the batches already trained (so a
DataLoader's worker seeds come out as before), sets the after-S state, and goes on.
"""
from __future__ import annotations

import os
import time

import torch

from ddtrain.reliability import checkpoint
from ddtrain.reliability import faults
from ddtrain.reliability import guard
from ddtrain.dist import runtime
from ddtrain.reliability import stall
from ddtrain.errors import DDTrainError


def _warn(message: str) -> None:
    runtime.eprint(f"ddtrain: warning: {message}")


class Keeper:
    def __init__(self, config, synced, optimizer, scaler, record: dict, data, *, epochs: int):
        self.config, self.synced, self.optimizer, self.scaler = config, synced, optimizer, scaler
        self.record, self.epochs = record, epochs
        self.module, self.group = synced.module, synced.group
        self.device = next(self.module.parameters()).device
        self.distributed = runtime.is_distributed()
        self.fingerprint = guard.fingerprint(config, self.module, data, runtime.world_size())
        self.step, self.epoch = 0, 1                 # where the loop starts
        self._skip, self._resume_part = 0, None
        self._meter, self._epoch_now, self._in_epoch, self._steps_per_epoch = None, 1, 0, None
        self._rng_epoch, self._loss_bad, self._epoch_t0 = None, False, time.perf_counter()
        inside = synced.spec.sync_in_backward
        self._forward_backward = "forward+backward" + (" (the gradient all-reduce runs inside backward)"
                                                       if inside else "")
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.info = record.setdefault("reliability", {
            "attempt": attempt, "resumed_from": None, "checkpoints_written": 0, "nonfinite_skipped": [],
            "replica_checks": 0, "rebroadcasts": []})

    # ---- start -----------------------------------------------------------------------------

    def resume(self) -> None:
        """Load the newest whole checkpoint when --resume is given or torchrun restarted us."""
        config, attempt = self.config, self.info["attempt"]
        if not config.reliability.checkpoint_dir or not (config.reliability.resume or attempt > 0):
            return
        got = checkpoint.restore(config.reliability.checkpoint_dir, required=config.reliability.resume, warn=_warn,
                                 check=lambda h: guard.check_resumable(h, self.fingerprint, config.reliability.checkpoint_dir))
        if got is None:
            runtime.print0(f"restart {attempt}: no checkpoint in {config.reliability.checkpoint_dir} yet, starting from step 0")
            return
        header, shared, part = got
        state = shared if shared is not None else part
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        checkpoint.set_rng_state(part["rng"])
        self.step, self.epoch, self._skip = header["step"], header["epoch"], header["step_in_epoch"]
        self._resume_part = part
        self.record["epochs"] = list(header.get("epochs_done", []))
        self.info["resumed_from"] = {"path": header["path"], "step": self.step, "epoch": self.epoch,
                                     "step_in_epoch": self._skip}
        why = f"restart {attempt}" if attempt else "--resume"
        runtime.print0(f"{why}: resumed from {header['path']} at step {self.step} "
                       f"(epoch {self.epoch}, {self._skip} of its steps done)")

    # ---- the loop's hooks ------------------------------------------------------------------

    def time_done(self, epoch: int) -> float:
        """Seconds this epoch had run when its checkpoint was taken (0 unless it is the resumed one)."""
        done = 0.0
        if epoch == self.epoch and self._skip and self._resume_part is not None:
            done = float(self._resume_part.get("epoch_time_s", 0.0))
        self._epoch_t0 = time.perf_counter() - done
        return done

    def begin_epoch(self, epoch: int, meter) -> int:
        """Steps of ``epoch`` already done (non-zero only for the epoch a checkpoint stopped in)."""
        self._meter, self._epoch_now = meter, epoch
        self._rng_epoch = checkpoint.rng_state()
        done = self._skip if epoch == self.epoch else 0
        if done and self._resume_part is not None:
            meter.sums.copy_(self._resume_part["meter"].to(meter.sums.device))
        self._in_epoch = done
        return done

    def batches(self, loader):
        """The loader's batches of this epoch, without the ones a resumed checkpoint already trained."""
        self._steps_per_epoch = loader.steps
        skip, part = self._in_epoch, self._resume_part
        it = iter(loader)
        if skip and part is not None:
            checkpoint.set_rng_state(part["rng_epoch"])
            self._rng_epoch = part["rng_epoch"]
            for _ in range(skip):
                next(it, None)
            checkpoint.set_rng_state(part["rng"])
            self._resume_part, self._skip = None, 0
        for batch in it:
            yield batch
        stall.mark(self.step, f"end of epoch {self._epoch_now} (metrics and validation)")

    def begin_step(self, step: int) -> None:
        stall.mark(step, self._forward_backward)
        faults.maybe_inject(step, runtime.rank(), self.module)

    def _checking(self, step: int) -> bool:
        # On a GPU each check is a host sync: every step only when skipping needs it.
        return self.config.reliability.on_nonfinite == "skip" or self.device.type != "cuda" or step % 50 == 0

    def check_loss(self, loss, step: int) -> None:
        """Before backward: in stop mode a non-finite loss ends the run naming this rank."""
        self._loss_bad = self._checking(step) and not bool(torch.isfinite(loss.detach()).all().item())
        if self._loss_bad and self.config.reliability.on_nonfinite == "stop":
            raise DDTrainError(f"non-finite loss ({loss.item()}) on rank {runtime.rank()} at step {step}; "
                               "lower --lr, check the data, or pass --on-nonfinite skip")

    def step_ok(self, step: int) -> bool:
        """After backward: False when this step must be skipped (on every rank alike)."""
        stall.mark(step, "optimizer step")
        if not self._checking(step):
            return True
        grads_bad = self.scaler is None and not guard.grads_finite(self.module)
        if self.config.reliability.on_nonfinite == "stop":
            if grads_bad:
                raise DDTrainError(f"non-finite gradients on rank {runtime.rank()} at step {step} (the loss was "
                                   "finite here; after an all-reduce every rank sees them); lower --lr or pass "
                                   "--on-nonfinite skip")
            return True
        stall.mark(step, "non-finite agreement (all-reduce of one flag per rank)")
        ranks, cause = guard.agree_on_bad(self._loss_bad, grads_bad, self.device, self.group)
        stall.mark(step, "optimizer step")
        if not ranks:
            return True
        self.info["nonfinite_skipped"].append({"step": step, "ranks": ranks, "cause": cause})
        if runtime.rank() == 0:
            _warn(f"non-finite {cause} at step {step} on rank {', '.join(map(str, ranks))}; "
                  f"step skipped on every rank ({len(self.info['nonfinite_skipped'])} so far)")
        return False

    def after_step(self, step: int, steps_done: int) -> None:
        """Checkpoint and replica check when due (the same steps on every rank)."""
        self.step, self._in_epoch = step, steps_done
        config = self.config
        end_of_epoch = steps_done == self._steps_per_epoch
        final = (config.steps and step >= config.steps) or (end_of_epoch and self._epoch_now >= self.epochs)
        if config.reliability.checkpoint_dir and (final or (step % config.reliability.checkpoint_every == 0 if config.reliability.checkpoint_every
                                                else end_of_epoch)):
            self.save(step)
        if step % config.sync.check_every == 0 if config.sync.check_every else end_of_epoch:
            self.check_replicas(step)

    # ---- the work --------------------------------------------------------------------------

    def save(self, step: int) -> None:
        stall.mark(step, "checkpoint (gather to rank 0)")
        replicated = self.synced.spec.replicated
        state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None}
        part = {"rng": checkpoint.rng_state(), "rng_epoch": self._rng_epoch, "meter": self._meter.sums,
                "epoch_time_s": time.perf_counter() - self._epoch_t0}
        if not replicated:
            part.update(state)
        header = {"step": step, "epoch": self._epoch_now, "step_in_epoch": self._in_epoch,
                  "strategy": self.config.strategy, "fingerprint": self.fingerprint,
                  "epochs_done": self.record["epochs"]}
        path = checkpoint.save(self.config.reliability.checkpoint_dir, step, header, part,
                               state if replicated and runtime.rank() == 0 else None, keep=self.config.reliability.keep)
        self.info["checkpoints_written"] += 1
        if path is not None:
            self.info["last_checkpoint"] = str(path)

    def _replicas_should_match(self, step: int) -> bool:
        return bool(self.synced.replicas_identical(step))

    def check_replicas(self, step: int) -> None:
        if not self.distributed or self.synced.role != "worker" or not self._replicas_should_match(step):
            return
        stall.mark(step, "replica checksum (all-gather)")
        diffs = guard.compare_replicas(self.module, self.group)
        self.info["replica_checks"] += 1
        if not diffs:
            return
        message = guard.describe_mismatch(step, diffs, self.group)
        if self.config.reliability.on_mismatch == "stop":
            cls = guard.ReplicaMismatch if runtime.rank() == 0 else guard.PeerStopped
            raise cls(message + "; stopping (--on-mismatch rebroadcast would copy rank 0's parameters instead)")
        guard.rebroadcast_(self.module, self.group)
        self.info["rebroadcasts"].append(step)
        if runtime.rank() == 0:
            _warn(message + "; rank 0's parameters were broadcast to every rank")
