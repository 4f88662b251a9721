"""``ddtrain bench data``: the input pipeline alone, in images per second.

What a training step waits for, without the model: the loader ``ddtrain train`` builds for the
same ``--data`` (its sampler, its loader processes or batched GPU pipeline, the copy to the
device, the normalisation), iterated on its own. ``--warmup`` batches first (loader processes
starting, caches filling) are not timed; then ``--steps`` batches are, until the device has
finished (``torch.cuda.synchronize``). A run longer than an epoch goes on into the next
epoch, as training does (restarting the loader processes is part of the time). With several
``--data`` specs the runs are interleaved (spec by spec, ``--repeats`` rounds) and each is
compared with the first: the ratio is measured in one run. ``--uint8`` stops the CPU path at the
uint8 batch it hands to a GPU (there the float conversion and normalisation run on the device):
the CPU's share of a GPU run's input pipeline, measured on a machine without one. Beside images/s, the CPU time the
pipeline's processes used per image (``CpuClock``): what the pipeline costs, which other jobs on
the machine change far less than its speed. If images/s here is below what the model trains at
with data already on the GPU, the run is data-bound (docs/DATA.md).
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ddtrain.bench.tables import fmt, render_table
from ddtrain.errors import DDTrainError


@dataclass
class DataBenchConfig:
    data: list[str]
    data_args: dict = field(default_factory=dict)
    batch_size: int = 256
    loader_workers: int = 0
    device: str = "auto"
    steps: int = 50
    warmup: int = 5
    repeats: int = 1
    channels_last: bool = False
    uint8: bool = False
    seed: int = 0

    def check(self) -> None:
        if not self.data:
            raise DDTrainError("bench data: give at least one --data SPEC")
        for name in ("batch_size", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise DDTrainError(f"bench data: --{name.replace('_', '-')} must be at least 1")
        for name in ("loader_workers", "warmup"):
            if getattr(self, name) < 0:
                raise DDTrainError(f"bench data: --{name.replace('_', '-')} must be >= 0")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise DDTrainError(f"bench data: --device {self.device!r} is not auto, cpu or cuda[:N]")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise DDTrainError(f"bench data: --device {self.device}: this machine has no CUDA device")


def device_of(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(name)


def open_loader(spec: str, config: DataBenchConfig, device: torch.device):
    """The loader ``ddtrain train`` would build for ``spec`` on one rank (the whole set as training data)."""
    from ddtrain.data import load_dataset
    from ddtrain.data.images import ProblemLog
    from ddtrain.data.loading import ShardLoader
    from ddtrain.data.sharding import ShardSampler
    try:
        data = load_dataset(spec, val_fraction=0.0, seed=config.seed, **config.data_args)
    except TypeError as exc:   # a --data-arg the format does not take
        raise DDTrainError(f"--data {spec}: {exc}") from None
    torch.manual_seed(config.seed)
    sampler = ShardSampler(len(data.train), rank=0, world_size=1, seed=config.seed)
    return ShardLoader(data.train, sampler, config.batch_size, device, workers=config.loader_workers,
                       on_device=False, channels_last=config.channels_last, problems=ProblemLog(report=lambda p: None),
                       uint8=config.uint8)


def time_loader(loader, steps: int, warmup: int, device: torch.device) -> dict:
    """Seconds for ``steps`` batches after ``warmup`` untimed ones, the images they held, and the CPU it took."""
    epoch, images, done, start, cpu = 0, 0, 0, None, CpuClock()
    while done < warmup + steps:
        loader.set_epoch(epoch)
        for batch in loader:
            x, y = batch
            done += 1
            if done == warmup:
                _sync(device)
                start = time.perf_counter()
                cpu.start()
            elif done > warmup:
                images += len(y)
            if done == warmup + steps:
                _sync(device)
                took, cpu_s = time.perf_counter() - start, cpu.stop()   # the loader processes still run
                break
        epoch += 1
    return {"time_s": took, "images": images, "batches": steps, "images_per_s": images / took if took > 0 else None,
            "cpu_s": cpu_s, "cpu_ms_per_image": 1e3 * cpu_s / images if cpu_s is not None and images else None,
            "epochs_started": epoch, "batch_shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", "")}


class CpuClock:
    """CPU seconds (user + system) of this process and its loader processes between ``start`` and ``stop``.

    Contention from other jobs stretches wall time but hardly CPU time, so CPU ms per image is the
    pipeline's cost where images/s is its speed on this machine now. Live children are read with
    psutil; those that ended in between (a new epoch's loader processes) through ``RUSAGE_CHILDREN``,
    less what they had used before ``start``. None without psutil.
    """

    def start(self) -> None:
        self.before = self._read()

    def stop(self) -> float | None:
        after = self._read()
        if self.before is None or after is None:
            return None
        (own0, kids0, reaped0), (own1, kids1, reaped1) = self.before, after
        ended = sum(t for pid, t in kids0.items() if pid not in kids1)
        return (own1 - own0) + sum(t - kids0.get(pid, 0.0) for pid, t in kids1.items()) + (reaped1 - reaped0) - ended

    @staticmethod
    def _read():
        try:
            import psutil
        except ImportError:
            return None
        import resource
        me = psutil.Process()
        kids = {}
        for child in me.children(recursive=True):
            try:
                t = child.cpu_times()
                kids[child.pid] = t.user + t.system
            except psutil.Error:      # ended between listing and reading: counted when reaped
                pass
        own = me.cpu_times()
        reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.user + own.system, kids, reaped.ru_utime + reaped.ru_stime


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(config: DataBenchConfig, progress=print) -> dict:
    """Time every spec's pipeline ``repeats`` times, interleaved; the result (``images_per_s`` of the first spec)."""
    config.check()
    device = device_of(config.device)
    warmup = max(config.warmup, 1)   # the clock starts after a batch: the first includes opening the loader
    runs = {spec: [] for spec in config.data}
    described = {}
    for round_ in range(config.repeats):
        for spec in config.data:
            loader = open_loader(spec, config, device)
            described[spec] = loader.describe()
            timed = time_loader(loader, config.steps, warmup, device)
            timed["problems"] = loader.problems.as_dict()
            runs[spec].append(timed)
            progress(f"# round {round_ + 1}/{config.repeats} {spec}: {fmt(timed['images_per_s'], 1)} images/s")
    rows = []
    for spec in config.data:
        rates = [r["images_per_s"] for r in runs[spec]]
        cpu = [r["cpu_ms_per_image"] for r in runs[spec] if r["cpu_ms_per_image"] is not None]
        rows.append({"data": spec, "images_per_s": statistics.median(rates), "all_images_per_s": rates,
                     "cpu_ms_per_image": statistics.median(cpu) if cpu else None,
                     "data_pipeline": described[spec], "runs": runs[spec]})
    first, first_cpu = rows[0]["images_per_s"], rows[0]["cpu_ms_per_image"]
    for row in rows:
        row["ratio_to_first"] = row["images_per_s"] / first if first else None
        row["cpu_ratio_to_first"] = first_cpu / row["cpu_ms_per_image"] if first_cpu and row["cpu_ms_per_image"] else None
    from ddtrain.observe.files import versions
    return {"images_per_s": first, "rows": rows,
            "settings": {**asdict(config), "device": str(device), "warmup": warmup},
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "uname": " ".join(platform.uname())},
            "versions": versions(None, device),
            "definition": "images/s = images in the timed batches / seconds from the end of the warm-up batches to "
                          "the last timed batch on the device; cpu ms/image = CPU seconds (user + system) of this "
                          "process and its loader processes over the same window, per image; cpu ratio = the first "
                          "row's cpu ms/image over this row's; medians over --repeats rounds"}


def table(result: dict) -> list[str]:
    s = result["settings"]
    lines = [f"# bench data: batch {s['batch_size']}, {s['loader_workers']} loader workers, device {s['device']}"
             f"{' (uint8 batches: the CPU share of a GPU run)' if s.get('uint8') else ''}, "
             f"{s['warmup']} warm-up + {s['steps']} timed batches, median of {s['repeats']} round(s)"]
    columns = [("data", ""), ("pipeline", ""), ("decoder", ""), ("images/s", "(median)"), ("ratio", "(to row 1)"),
               ("cpu", "(ms/image)"), ("cpu ratio", "(row 1 / this)"), ("skipped", "(files)")]
    rows = [[r["data"], r["data_pipeline"].get("pipeline", ""), r["data_pipeline"].get("decoder", "").split(",")[0],
             fmt(r["images_per_s"], 1), fmt(r["ratio_to_first"], 2), fmt(r["cpu_ms_per_image"], 2),
             fmt(r["cpu_ratio_to_first"], 2), str(max(run["problems"]["files_skipped"] for run in r["runs"]))]
            for r in result["rows"]]
    return lines + render_table(columns, rows)
