"""Experiment tracking on rank 0: TensorBoard event files, an MLflow run, a Weights & Biases run, a CSV.

Each tracker is a callback of the training loop (hook methods only: observe sits below training)
that writes what the loop measures anyway: per step the loss (rank 0's, averaged over its
micro-batches), the learning rate, samples per second (global batch over the step's wall time)
and, with ``--profile``, the step split (data, compute, optimizer seconds from the loop's clock
readings); per epoch the epoch's metrics (train and validation loss and accuracy, samples/s, the
split) and the bytes this rank sent and received. The libraries are optional (``pip install
'ddtrain[tensorboard]'``, ``'ddtrain[mlflow]'``, ``'ddtrain[wandb]'``, or ``'ddtrain[tracking]'`` for
TensorBoard and MLflow): ``check`` names the missing one, and its extra, before training starts.

Reading a step's loss is a host-device sync on a GPU: the step's loss tensors are kept (detached)
and read together, one ``tolist()`` every ``FLUSH_STEPS`` tracked steps (or ``FLUSH_S`` seconds),
at each epoch's end and at the end. An output that fails (a full disk: ``OSError``) is named once in
a warning and written no more; training goes on to its checkpoints, record and model.
"""
from __future__ import annotations

import csv
import math
import os
import sys
import time
from dataclasses import dataclass

from ddtrain.errors import ConfigError


@dataclass(kw_only=True)
class TrackingConfig:
    """Tracking (rank 0 writes; docs/DEPENDENCIES.md names the libraries)."""

    tensorboard: str | None = None     # write TensorBoard event files (scalars per step and epoch) into this directory
    mlflow: bool = False                  # log the configuration and the metrics to an MLflow run (at MLFLOW_TRACKING_URI, else MLflow's default)
    csv: str | None = None             # write per-step and per-epoch metrics to this CSV file
    wandb: bool = False                   # log the configuration and the metrics to a Weights & Biases run (WANDB_PROJECT, WANDB_MODE=offline: no server)
    track_every: int = 1                  # optimizer steps between tracked step metrics

    def __post_init__(self):
        if not isinstance(self.track_every, int) or isinstance(self.track_every, bool) or self.track_every < 1:
            raise ConfigError("track_every", f"must be a positive integer, got {self.track_every!r}")
        if self.csv is not None and not str(self.csv).endswith(".csv"):
            raise ConfigError("csv", f"{self.csv!r} should name a .csv file")

    @property
    def enabled(self) -> bool:
        return bool(self.tensorboard or self.mlflow or self.csv or self.wandb)


def check(config: TrackingConfig) -> None:
    """Before any worker starts: the libraries are installed and the outputs writable (one message)."""
    from ddtrain.observe import files
    if config.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (needs the tensorboard package)
        except ImportError:
            raise ConfigError("tensorboard", "needs the tensorboard package: pip install 'ddtrain[tensorboard]' "
                               "(or pip install tensorboard)") from None
        _check_dir(config.tensorboard)
    if config.mlflow:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise ConfigError("mlflow", "needs the mlflow package: pip install 'ddtrain[mlflow]' "
                               "(or pip install mlflow)") from None
    if config.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("wandb", "needs the wandb package: pip install 'ddtrain[wandb]' "
                               "(or pip install wandb)") from None
    files.check_writable(config.csv, "csv")


def _check_dir(path: str) -> None:
    """The directory exists or can be made, and a file can be created in it."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".ddtrain-write-check-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ConfigError("tensorboard", f"{path!r}: cannot write there ({exc.strerror or exc})") from None


def trackers(config: TrackingConfig, rank: int) -> list:
    """The tracking callbacks ``config`` asks for, on rank 0 (none elsewhere)."""
    if rank != 0 or not config.enabled:
        return []
    check(config)
    out: list = []
    if config.tensorboard:
        out.append(TensorBoardTracker(config.tensorboard, config.track_every))
    if config.mlflow:
        out.append(MLflowTracker(config.track_every))
    if config.wandb:
        out.append(WandbTracker(config.track_every))
    if config.csv:
        out.append(CSVTracker(config.csv, config.track_every))
    return out


# Loss values read from the device together: at most this many tracked steps, or this many seconds, apart
FLUSH_STEPS, FLUSH_S = 50, 10.0


class Tracker:
    """What every tracker measures; subclasses say where a scalar goes (``scalar``) and close their sink.

    ``output`` names the sink in messages (``--csv FILE``). A sink that raises ``OSError`` (a full
    disk, a lost mount) is reported once and dropped (``failed``): tracking never stops training.
    """

    output = "tracking"

    def __init__(self, every: int):
        self.every = every
        self.pending: list = []   # (step, epoch, loss tensor or number, the step's other metrics), not yet written
        self.flushed_at = time.monotonic()
        self.failed: str | None = None

    def on_train_begin(self, state) -> None:
        self._guarded(lambda: self.open(state), step=state.step)

    def on_step_end(self, step, logs, state) -> None:
        if step % self.every or self.failed:
            return
        config = state.config
        loss = logs["loss"]   # the step's loss tensor: kept detached, read at the next flush (no sync per step)
        metrics = {}
        schedule = getattr(state, "schedule", None)
        if schedule is not None:
            metrics["lr"] = schedule.lr(step - 1)      # the rate the update just taken used
        else:
            metrics["lr"] = state.optimizer.param_groups[0]["lr"]
        wall = logs["end_s"] - logs["begin_s"]
        batch = state.record.get("global_batch_size") or config.recipe.batch_size
        if wall > 0:
            metrics["samples_per_s"] = batch / wall
        if config.profile.enabled:
            metrics["data_s"] = logs["data_end_s"] - logs["begin_s"]
            metrics["compute_s"] = logs["compute_end_s"] - logs["data_end_s"]
            metrics["optimizer_s"] = logs["end_s"] - logs["compute_end_s"]
        self.pending.append((step, state.epoch, loss.detach() if hasattr(loss, "detach") else loss, metrics))
        if len(self.pending) >= FLUSH_STEPS or time.monotonic() - self.flushed_at >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        """Write the steps kept so far: their losses read from the device in one go."""
        pending, self.pending = self.pending, []
        self.flushed_at = time.monotonic()
        if not pending or self.failed:
            return
        import torch
        losses = [p[2] for p in pending]
        if all(isinstance(v, torch.Tensor) for v in losses):
            values = torch.stack([v.reshape(()).float() for v in losses]).tolist()   # one sync for all of them
        else:
            values = [float(v) for v in losses]
        for (step, epoch, _, metrics), value in zip(pending, values):
            self._guarded(lambda: self.write("step", step, epoch, {"loss": value, **metrics}), step=step)

    def on_epoch_end(self, epoch, logs, state) -> None:
        self.flush()
        metrics = {k: logs[k] for k in ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "samples_per_s",
                                        "time_s") if isinstance(logs.get(k), (int, float))}
        for part, seconds in (logs.get("step_split_s") or {}).items():
            metrics[part] = seconds
        strategy = state.strategy
        strategy.update_stats()                          # local counters: no communication
        metrics["bytes_sent"] = strategy.stats.bytes_sent
        metrics["bytes_received"] = strategy.stats.bytes_received
        self._guarded(lambda: self.write("epoch", state.step, epoch, metrics), step=state.step)

    def on_train_end(self, record, state) -> None:
        self.flush()
        self._guarded(self.close, step=state.step)
        if self.failed:
            record.setdefault("tracking_failed", []).append(self.failed)

    def _guarded(self, action, *, step) -> None:
        """Run ``action`` on the sink; an OSError drops the sink with one warning naming it (training goes on)."""
        if self.failed:
            return
        try:
            action()
        except OSError as exc:
            import errno as errno_
            code = f" [errno {exc.errno}]" if exc.errno else ""
            why = (exc.strerror or errno_.errorcode.get(exc.errno or 0) or str(exc)) + code
            self.failed = f"{self.output}: {why} at step {step}"
            print(f"ddtrain: warning: {self.output}: could not be written ({why}) at step {step}; nothing more is "
                  "written to it, training goes on (the rows before it are kept)", file=sys.stderr, flush=True)
            try:
                self.close()
            except OSError:
                pass

    def write(self, kind: str, step: int, epoch: int, metrics: dict) -> None:
        for name, value in metrics.items():
            if value is not None and math.isfinite(float(value)):
                self.scalar(f"{kind}/{name}", float(value), step)

    def open(self, state) -> None: ...
    def scalar(self, tag: str, value: float, step: int) -> None: ...
    def close(self) -> None: ...


class TensorBoardTracker(Tracker):
    """Scalars ``step/loss``, ``step/lr``, ``epoch/val_accuracy``, ... in ``DIR``'s event files."""

    def __init__(self, log_dir: str, every: int = 1):
        super().__init__(every)
        self.log_dir, self.writer = log_dir, None
        self.output = f"--tensorboard {log_dir}"

    def open(self, state) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=self.log_dir)
        self.writer.add_text("config", "```\n" + _config_text(state.config) + "\n```", 0)

    def scalar(self, tag, value, step) -> None:
        self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()


class MLflowTracker(Tracker):
    """An MLflow run: the flat configuration as parameters, the scalars as metrics (tags with ``/`` become ``_``)."""

    output = "--mlflow"

    def __init__(self, every: int = 1):
        super().__init__(every)
        self.run, self.started = None, False

    def open(self, state) -> None:
        import mlflow
        if mlflow.active_run() is None:
            self.run, self.started = mlflow.start_run(), True
        flat = state.config.flat()
        # MLflow caps a parameter value's length; long dicts are cut, not refused
        mlflow.log_params({k: str(v)[:250] for k, v in flat.items()})

    def scalar(self, tag, value, step) -> None:
        import mlflow
        mlflow.log_metric(tag.replace("/", "_"), value, step=step)

    def close(self) -> None:
        if self.started:
            import mlflow
            mlflow.end_run()
            self.started = False


class WandbTracker(Tracker):
    """A Weights & Biases run: the nested configuration as its config, the scalars (``step/loss``, ...) logged.

    wandb reads its own variables (WANDB_PROJECT, WANDB_ENTITY, WANDB_DIR, WANDB_MODE=offline
    for a run written to disk only and synced later with ``wandb sync``); a run the script has
    already started (``wandb.init`` in a ``fit()`` script) is logged into and left open.
    """

    output = "--wandb"

    def __init__(self, every: int = 1):
        super().__init__(every)
        self.run, self.started = None, False
        self.rows: dict = {}   # step -> its scalars: one wandb.log per step (wandb's steps only go forward)

    def open(self, state) -> None:
        import wandb
        self.run = wandb.run
        if self.run is None:
            self.run, self.started = wandb.init(project=os.environ.get("WANDB_PROJECT", "ddtrain"),
                                                config=state.config.as_dict()), True
        else:
            self.run.config.update(state.config.as_dict(), allow_val_change=True)
        # every scalar's x axis is the optimizer step, also the epoch rows written at the epoch's last step
        self.run.define_metric("*", step_metric="optimizer_step")

    def write(self, kind, step, epoch, metrics) -> None:
        row = self.rows.setdefault(step, {"optimizer_step": step, "epoch": epoch})
        row.update({f"{kind}/{k}": float(v) for k, v in metrics.items()
                    if v is not None and math.isfinite(float(v))})

    def flush(self) -> None:
        super().flush()
        for step in sorted(self.rows):
            self.run.log(self.rows[step])
        self.rows = {}

    def close(self) -> None:
        if self.rows and self.run is not None:
            self.flush()
        if self.started:
            self.run.finish()
            self.started = False


CSV_COLUMNS = ("kind", "step", "epoch", "loss", "lr", "samples_per_s", "data_s", "compute_s", "optimizer_s",
               "train_loss", "train_accuracy", "val_loss", "val_accuracy", "time_s", "bytes_sent", "bytes_received")


class CSVTracker(Tracker):
    """One row per tracked step (``kind`` step) and per epoch (``kind`` epoch), fixed columns ``CSV_COLUMNS``."""

    def __init__(self, path: str, every: int = 1):
        super().__init__(every)
        self.path, self.file, self.writer = path, None, None
        self.output = f"--csv {path}"

    def open(self, state) -> None:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        self.file = open(self.path, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        self.writer.writeheader()

    def write(self, kind, step, epoch, metrics) -> None:
        row = {"kind": kind, "step": step, "epoch": epoch}
        row.update({k: (f"{v:.8g}" if isinstance(v, float) else v) for k, v in metrics.items() if v is not None})
        self.writer.writerow(row)
        self.file.flush()   # a run that dies keeps its rows

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            file.close()


def _config_text(config) -> str:
    return "\n".join(f"{k} = {v!r}" for k, v in config.flat().items())
