"""What ``gpu_single.py`` looks at inside a timed run: the GPU's data wait and a kernel profile.

DataWait  CUDA events recorded on the training stream just before and just after the loop
          takes each batch from its loader. The GPU reaches the first event when it has
          finished the previous step's work and the second when the batch is ready on that
          stream, so the time between them is what the GPU spends on (or waits for) data:
          gather kernels, host-to-device copies not yet finished, or an idle GPU while the
          host is still producing the batch. Summed over the timed steps and divided by the
          timed window, it is the data wait share of step time (docs/PERFORMANCE.md).
KernelProfile  torch.profiler over a few timed steps; GPU kernel time grouped into kinds
          (convolution, matrix products, normalisation, fused Triton kernels, optimizer,
          element-wise, copies, communication) and the GPU idle share of the window.
"""
from __future__ import annotations

import re
import time

import torch

import ddtrain
from ddtrain.data import loading


class DataWait:
    """Context manager: events around every batch any ``ShardLoader`` hands over while active."""

    def __enter__(self):
        self.pairs, self._orig = [], loading.ShardLoader.__iter__
        probe = self

        def timed_iter(loader):
            inner = probe._orig(loader)
            try:
                while True:
                    before = torch.cuda.Event(enable_timing=True)
                    before.record()
                    try:
                        batch = next(inner)
                    except StopIteration:
                        return
                    after = torch.cuda.Event(enable_timing=True)
                    after.record()
                    probe.pairs.append((before, after))
                    yield batch
            finally:
                inner.close()

        loading.ShardLoader.__iter__ = timed_iter
        return self

    def __exit__(self, *exc):
        loading.ShardLoader.__iter__ = self._orig

    def seconds(self, first: int, count: int) -> float:
        """GPU data time of fetches ``first .. first+count-1`` (0 = the run's first batch)."""
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self.pairs[first:first + count]) / 1e3


KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("fused (Triton)", r"^triton_"),  # inductor's fused kernels (their names list the fused operators)
    ("communication", r"nccl"),
    ("copies", r"memcpy|memset|copy_|CatArray|index_select|indexSelect|gather"),
    ("optimizer", r"multi_tensor|foreach|_amp_update|sgd"),
    ("convolution", r"conv|cudnn|implicit_gemm|dgrad|wgrad|fprop|xmma_fprop|nhwc"),
    ("matrix products", r"gemm|cutlass|sm90_|nvjet|matmul"),
    ("normalisation", r"batch_norm|batchnorm|bn_|welford|norm"),
    ("element-wise and reductions", r"elementwise|vectorized|reduce|unrolled|softmax|nll|loss|relu|pool"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


class KernelProfile(ddtrain.Callback):
    """torch.profiler from step ``start`` for ``steps`` steps; ``summary()`` after the run."""

    def __init__(self, start: int, steps: int):
        self.start, self.steps, self.prof, self.window_s = start, steps, None, None

    def on_step_begin(self, step, state):
        if step == self.start:
            torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def on_step_end(self, step, logs, state):
        if self.prof is not None and self.window_s is None and step == self.start + self.steps:
            torch.cuda.synchronize()
            self.window_s = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)

    def summary(self, top: int = 20) -> dict:
        kernels: dict[str, float] = {}
        for e in self.prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e6
        if not kernels:  # no kernel events in this torch: operators' own GPU time instead
            kernels = {a.key: a.self_device_time_total / 1e6 for a in self.prof.key_averages()
                       if a.self_device_time_total > 0}
        kinds: dict[str, float] = {}
        for name, s in kernels.items():
            kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + s
        busy = sum(kernels.values())
        per_step = {k: v / self.steps for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
        return {"steps": self.steps, "window_s": self.window_s, "step_s": self.window_s / self.steps,
                "kernel_s_per_step": per_step, "busy_share": busy / self.window_s,
                "top_kernels": [{"name": n[:120], "s_per_step": s / self.steps, "kind": kind_of(n)}
                                for n, s in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]],
                "all_kernels_s_per_step": {n: s / self.steps for n, s in kernels.items()}}


def print_profile(label: str, p: dict) -> None:
    step = p["step_s"]
    print(f"\n# kernel profile of ddtrain ddp, {label}: {p['steps']} steps, {step * 1e3:.1f} ms/step, "
          f"GPU busy {p['busy_share']:.1%} of the window (kernels may overlap: communication streams)")
    for kind, s in p["kernel_s_per_step"].items():
        print(f"  {kind:<30} {s * 1e3:8.2f} ms/step  {s / step:6.1%}")
    print("# top kernels")
    for k in p["top_kernels"]:
        print(f"  {k['s_per_step'] * 1e3:8.2f} ms  {k['kind']:<18} {k['name'][:90]}")
