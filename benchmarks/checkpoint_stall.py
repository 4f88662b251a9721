"""How long a checkpoint stops training: written in the background (the default) against on the training thread.

    PYTHONPATH=src python3 benchmarks/checkpoint_stall.py --out results/preemption/checkpoint_stall.json

ResNet-50 (ddtrain's own ``resnet50``, 1000 classes: 25.6 M parameters, 102 MB in float32, 204 MB of
checkpointed state with SGD's momentum), trained in one process with one torch thread on 3x32x32 inputs,
``--steps`` steps with a checkpoint every ``--every``, three times: without checkpoints, with checkpoints
written in the background, and with ``--checkpoint-sync``. Per checkpoint, the **stall**: the wall seconds
the training thread spends in ``Checkpointer.save`` (``record["reliability"]["checkpoint_stall_s"]``), and
that thread's CPU seconds there (``time.thread_time``, which other processes on the machine hardly move);
in the background mode also the part of the stall spent waiting for the previous write (none when
``--every`` steps take longer than a write).
Per run: the wall time, and its excess over the run without checkpoints per checkpoint (what a checkpoint
costs in all, the background thread's competition for the cores included).

Then the **time from a stop signal to the checkpoint on disk**: in each mode a SIGTERM from a timer half
way into a step; the run finishes the step, saves, waits for the write and returns; the record's
``preempted`` has the signal's time and the time the file was on disk. Reported with its parts: the rest of
the step in flight, and the save with its write.

Correctness (``wrong``): the last checkpoint of the background run holds bit for bit the model and optimizer
state of the synchronous run's, and the preemption checkpoints hold the step they say. One JSON file.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import tempfile
import threading
import time

import torch

from ddtrain import TrainConfig, fit
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.models import build_model
from ddtrain.reliability import checkpoint
from ddtrain.reliability.checkpoint import Checkpointer

BATCH, SIDE, CLASSES = 2, 32, 1000


def data(samples: int) -> Data:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 3, SIDE, SIDE, generator=g)
    y = torch.randint(0, CLASSES, (samples,), generator=g)
    return Data("synthetic", ArrayDataset(x, y, num_classes=CLASSES), None, CLASSES, (3, SIDE, SIDE), "classification")


def model():
    torch.manual_seed(0)
    return build_model("resnet50", num_classes=CLASSES, in_channels=3, input_size=(SIDE, SIDE))


class Clock:
    """Each step's wall seconds (the loop's own clock readings) and the wall/CPU seconds of every save."""

    def __init__(self, signal_at_step: int | None = None):
        self.steps, self.saves, self.signal_at_step, self.ends = [], [], signal_at_step, {}

    def on_step_end(self, step, logs, state):
        self.steps.append(logs["end_s"] - logs["begin_s"])
        self.ends[step] = time.time()
        if step == self.signal_at_step:   # a SIGTERM half way into the next step
            half = statistics.median(self.steps[1:] or self.steps) / 2
            threading.Timer(half, os.kill, (os.getpid(), signal.SIGTERM)).start()


def timed_saves(clock: Clock):
    """Wrap Checkpointer.save to add (wall s, training-thread CPU s) of each save to ``clock.saves``."""
    original = Checkpointer.save

    def save(self, step, steps_done):
        wall, cpu = time.perf_counter(), time.thread_time()
        original(self, step, steps_done)
        clock.saves.append((time.perf_counter() - wall, time.thread_time() - cpu))
    Checkpointer.save = save
    return lambda: setattr(Checkpointer, "save", original)


def one_run(folder, mode: str, steps: int, every: int, signal_at_step: int | None = None) -> dict:
    clock = Clock(signal_at_step)
    settings = dict(model="resnet50", data="synthetic", epochs=1, steps=steps, batch_size=BATCH, lr=0.01,
                    momentum=0.9, seed=0, val_fraction=0.0, quiet=True)
    directory = None
    if mode != "none":
        directory = os.path.join(folder, f"{mode}-{'stop' if signal_at_step else 'every'}")
        settings.update(checkpoint_dir=directory, checkpoint_every=every if not signal_at_step else 100_000,
                        checkpoint_sync=mode == "sync")
    undo = timed_saves(clock)
    try:
        began = time.perf_counter()
        record = fit(model(), data(steps * BATCH), TrainConfig.from_flat(**settings), callbacks=[clock])
        wall = time.perf_counter() - began
    finally:
        undo()
    out = {"mode": mode, "wall_s": round(wall, 3), "steps": steps,
           "step_s_median": round(statistics.median(clock.steps), 3),
           "checkpoint_stall_s": [round(w, 4) for w, _ in clock.saves],
           "checkpoint_write_wait_s": [round(w, 4) for w in record["reliability"].get("checkpoint_write_wait_s", [])],
           "checkpoint_stall_thread_cpu_s": [round(c, 4) for _, c in clock.saves], "directory": directory}
    stopped = record["reliability"].get("preempted")
    if stopped:
        step_end = clock.ends[stopped["step"]]
        out["preempted"] = {"step": stopped["step"],
                            "signal_to_checkpoint_s": round(stopped["stopped_at"] - stopped["signal_at"], 3),
                            "rest_of_step_s": round(step_end - stopped["signal_at"], 3),
                            "save_and_write_s": round(stopped["stopped_at"] - step_end, 3),
                            "checkpoint": stopped["checkpoint"]}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--every", type=int, default=12,
                   help="steps between checkpoints: more than a write takes, or each save waits for the previous write")
    p.add_argument("--out", default=None, help="write the results here (JSON)")
    args = p.parse_args()
    torch.set_num_threads(1)
    params = sum(t.numel() for t in model().parameters())
    runs, wrong = {}, []
    with tempfile.TemporaryDirectory(prefix="ddtrain-stall-") as folder:
        for mode in ("none", "background", "sync"):
            runs[mode] = one_run(folder, mode, args.steps, args.every)
            print(json.dumps(runs[mode]), flush=True)
        # the two modes wrote the same state
        last = (args.steps // args.every) * args.every
        a = checkpoint.read(checkpoint.path_for(runs["background"]["directory"], last))[1]["shared"]
        b = checkpoint.read(checkpoint.path_for(runs["sync"]["directory"], last))[1]["shared"]
        same = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and \
            all(torch.equal(x, y) for s, t in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values())
                for x, y in zip(s.values(), t.values()) if isinstance(x, torch.Tensor))
        if not same:
            wrong.append(f"step {last}: the background checkpoint differs from the synchronous one")
        stops = {}
        for mode in ("background", "sync"):
            stops[mode] = one_run(folder, mode, args.steps, args.every, signal_at_step=3)
            print(json.dumps(stops[mode]), flush=True)
            got = stops[mode].get("preempted")
            if not got or checkpoint.read(got["checkpoint"])[0]["step"] != got["step"]:
                wrong.append(f"{mode}: no preemption checkpoint of the stop step")
    summary = {}
    for mode in ("background", "sync"):
        run = runs[mode]
        n = len(run["checkpoint_stall_s"])
        summary[mode] = {"checkpoints": n, "stall_s_median": statistics.median(run["checkpoint_stall_s"]),
                         "stall_thread_cpu_s_median": statistics.median(run["checkpoint_stall_thread_cpu_s"]),
                         "cost_per_checkpoint_s": round((run["wall_s"] - runs["none"]["wall_s"]) / n, 3),
                         "signal_to_checkpoint_s": (stops[mode].get("preempted") or {}).get("signal_to_checkpoint_s")}
    summary["stall_ratio_sync_over_background"] = round(summary["sync"]["stall_s_median"]
                                                         / summary["background"]["stall_s_median"], 1)
    result = {"what": "checkpoint stall per checkpoint, background write against synchronous (issue 28)",
              "model": "resnet50 (ddtrain.models), 1000 classes, 3x32x32 inputs, batch 2, SGD momentum 0.9",
              "parameters": params, "state_bytes": 2 * 4 * params, "torch_threads": 1,
              "machine": {"cpus": os.cpu_count(), "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                          "python": platform.python_version(), "torch": torch.__version__},
              "command": "PYTHONPATH=src python3 benchmarks/checkpoint_stall.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
              "summary": summary, "runs": runs, "preemption": stops, "wrong": wrong}
    print(json.dumps(summary, indent=1))
    print(f"#wrong {len(wrong)}" + (": " + "; ".join(wrong) if wrong else ""))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
