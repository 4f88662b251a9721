"""What a training run measures about itself: per-step time split, timelines, system monitoring.

``ddtrain train --profile`` (implied by ``--trace FILE`` and ``--monitor-system``) adds a ``Profiler``
callback to ``fit``; ``ddtrain bench scaling`` turns it on for every cell. It adds to the
results record before ``fit`` writes it:

* ``profile``: per rank, the mean seconds per timed step (the steady steps: warm-up left out,
  ``warmup_rule`` below) of
  ``data_s`` (waiting for the batch, plus the loop's per-step bookkeeping), ``compute_s``
  (forward+backward), ``comm_wait_s`` (blocked on communication), ``optimizer_s``, and
  ``other_s`` (in-loop work after the last step of an epoch: replica checks, checkpoints), next
  to the wall-clock step time they tile (``step_time_s``); ``split_sum_pct`` is the share of
  the step the four named parts explain;
* ``monitor`` (``--monitor-system``): ``ddtrain.observe.monitor`` samples of every rank on one time axis;
* ``--trace FILE``: the Chrome trace of ``ddtrain.observe.timeline``, and a straggler line.

Which steps are warm-up (``--profile-warmup-steps auto``, the default; a number N leaves out the
first N steps instead), from each step's wall time on this rank:

1. the run's first step, always: it holds what happens once (CUDA context, cuDNN's algorithm
   choice, the allocator's first blocks, the loader processes' start, and under ``--compile``
   torch.compile's tracing and compiling, minutes for ResNet-50);
2. the steps after it, as long as each is more than ``WARM_FACTOR`` times the median of the steps
   that follow it (a warm-up that lasts: CUDA-graph recording in the second and third calls,
   lazy initialisation in the optimizer's first steps);
3. under ``--compile`` only, any later step more than ``RECOMPILE_FACTOR`` times the median of
   the steps kept: a recompilation (a new batch shape, such as an epoch's shorter last batch).

The record lists the steps left out and why (``left_out``); the first step's time is kept
apart (``first_step_s``), so compile time is reported, not averaged into the steady split.

The step's spans are the loop's own clock readings, handed to ``on_step_end`` in its logs.
How the communication wait is found (docs/PERFORMANCE.md, "Step split"): a hook on every
parameter notes when its gradient is accumulated; what ``forward+backward`` lasts after the
last of them is waiting for the gradient sync (DDP's all-reduce not hidden behind the
backward pass). Exchanges of our own algorithms (``ddtrain.comm``) run by the training
thread are blocking waits wherever they fall (inside backward for a DDP hook, in the
optimizer step for parameter servers); they are taken out of compute or optimizer time.
"""
from __future__ import annotations

import statistics
import threading
import time

from ddtrain.comm import traffic
from ddtrain.distributed import runtime
from ddtrain.observe import files
from ddtrain.observe.step_split import split_steps
from ddtrain.observe.timeline import chrome_trace, estimate_offsets, straggler_summary

PARTS = ("data_s", "compute_s", "comm_wait_s", "optimizer_s")
WARM_FACTOR = 3.0        # a leading step this many times the median of the later ones is still warm-up
RECOMPILE_FACTOR = 10.0  # under --compile, a later step this many times the median is a recompilation
DATA_BOUND_SHARE = 0.2   # a data wait above this share of the step is named in the summary line


def warmup(step_s: list[float], compiled: bool) -> tuple[int, list[int], list[str]]:
    """(leading warm-up steps, positions of later recompilations, the reasons) for these step times.

    The rule of the module docstring; positions index ``step_s``.
    """
    import statistics
    n = len(step_s)
    if n < 2:
        return 0, [], []
    warm, why = 1, ["the first step (one-time start-up" + (", torch.compile's compile)" if compiled else ")")]
    while warm < n - 1 and step_s[warm] > WARM_FACTOR * statistics.median(step_s[warm + 1:]):
        warm += 1
    if warm > 1:
        why.append(f"{warm - 1} more leading step(s) over {WARM_FACTOR:g}x the median of the steps after them")
    later = recompilations(step_s, warm, compiled)
    if later:
        why.append(f"{len(later)} later step(s) over {RECOMPILE_FACTOR:g}x the median: recompilations")
    return warm, later, why


def recompilations(step_s: list[float], warm: int, compiled: bool) -> list[int]:
    """Positions after the ``warm`` first steps of a compiled run's steps over RECOMPILE_FACTOR x their median."""
    import statistics
    if not compiled or len(step_s) - warm <= 2:
        return []
    typical = statistics.median(step_s[warm:])
    return [i for i in range(warm, len(step_s)) if step_s[i] > RECOMPILE_FACTOR * typical]


def callbacks(config) -> list:
    """The callbacks a run's ``ProfileConfig`` asks for (none when measurement is off)."""
    if not config.enabled:
        return []
    return [Profiler(trace_path=config.trace, monitor=config.monitor_system, interval_s=config.monitor_every,
                     warmup_steps=config.warmup_steps)]


class Profiler:
    """The measurement callback (see the module docstring); all ranks, servers included, run it.

    A callback of the training loop's ``fit`` by its hook methods (no base class: observe sits
    below training).
    """

    def __init__(self, *, trace_path=None, monitor=False, interval_s=0.5, warmup_steps="auto"):
        self.trace_path, self.monitor_on, self.interval_s = trace_path, monitor, interval_s
        self.warmup_steps = warmup_steps
        self.monitor = None
        self._spans: list[tuple] = []
        self._buckets: list[dict] = []
        self._grad_done_s = None
        # (step, begin, data end, compute end, end: the loop's readings; wall end, grad done: ours)
        self._step_times: list[tuple] = []
        self._cpu_ends: list[float] = []    # this process's CPU seconds (all threads) at each step end
        self._step = 0

    # -- recording (cheap: a clock read and an append) --------------------------------
    def on_train_begin(self, state):
        self.synced = state.strategy
        self.batch_size = state.config.recipe.batch_size
        self.compiled = bool(getattr(state.config, "compile", False))
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in state.model.parameters() if p.requires_grad)
        self.clock = estimate_offsets()
        self.origin_s = time.perf_counter()
        self.wall_minus_perf = _wall_minus_perf()
        self._threads = {threading.get_ident()}
        traffic.add_hook(self._on_span)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for p in state.model.parameters() if p.requires_grad]
        self.ddp_note = self._time_ddp_buckets() if self.trace_path else None
        # On a GPU the host's clock readings say where the host blocked, not where the GPU spent its
        # time (issue 20: 33.8 ms of "data wait" on rank 0 for GPU-resident data): events on the
        # training stream give the split the tables use; the host's stays beside it, labelled.
        self.gpu = None
        if state.device.type == "cuda" and state.strategy.role == "worker":
            from ddtrain.observe.gpu_split import GpuStepEvents
            self.gpu = GpuStepEvents(state.model, state.optimizer, state.device)
        if self.monitor_on:
            from ddtrain.observe.monitor import Monitor
            self.monitor = Monitor(self.interval_s, device=runtime.device(),
                                   strategy_stats=lambda: self.synced.stats).start()

    def on_epoch_begin(self, epoch, state):
        if self.gpu is not None:
            self.gpu.epoch_begin()

    def on_step_begin(self, step, state):
        self._grad_done_s, self._step = None, step
        if self.gpu is not None:
            self.gpu.step_begin(step)

    def on_step_end(self, step, logs, state):
        self._step_times.append((self._step, logs["begin_s"], logs["data_end_s"], logs["compute_end_s"], logs["end_s"],
                                 time.perf_counter(), self._grad_done_s))
        self._cpu_ends.append(time.process_time())
        if self.gpu is not None:
            self.gpu.step_end()

    def _on_grad(self, _param):
        self._grad_done_s = time.perf_counter()
        self._threads.add(threading.get_ident())

    def _on_span(self, span):
        w = self.wall_minus_perf
        self._spans.append((span.name, span.start_s - w, span.end_s - w, span.peer, span.nbytes, span.direction,
                            threading.get_ident()))

    def _time_ddp_buckets(self):
        """Per-bucket spans for plain DDP: a comm hook doing what DDP's default all-reduce does, timed."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = self.synced.model
        if not isinstance(model, DDP) or getattr(model, "_comm_hooks", None):
            return None

        def hook(group, bucket):
            start, step = time.perf_counter(), self._step
            nbytes = bucket.buffer().numel() * bucket.buffer().element_size()

            def done(fut):
                self._buckets.append({"index": bucket.index(), "start_s": start, "end_s": time.perf_counter(),
                                      "nbytes": nbytes, "step": step})
                return fut.value()[0] if isinstance(fut.value(), list) else fut.value()
            return allreduce_hook(group, bucket).then(done)

        model.register_comm_hook(model.process_group, hook)
        return "with --trace, DDP's all-reduce runs through a timing comm hook (torch's allreduce_hook)"

    # -- summarising (once, at the end) -------------------------------------------------
    def _steps(self) -> list[dict]:
        steps, walls = [], []
        for step, begin, data_end, compute_end, end, wall, grad in sorted(self._step_times, key=lambda t: t[0]):
            steps.append({"step": step, "begin_s": begin, "data_end_s": data_end, "compute_end_s": compute_end,
                          "end_s": end, "grad_done_s": grad})
            walls.append(wall)
        for i, (s, wall) in enumerate(zip(steps, walls)):
            if i + 1 == len(steps):
                s["wall_end_s"] = s["end_s"]     # the run's last step: what follows is the end of the run
                continue
            following = steps[i + 1]["begin_s"]
            # the next step starts where this one's optimizer ended, unless an epoch ended in between
            s["wall_end_s"] = following if following == s["end_s"] else (wall or s["end_s"])
        return steps

    def summary(self) -> dict:
        """This rank's part of the profile (and its raw material for the trace)."""
        steps = self._steps()
        blocking = [(s[1], s[2]) for s in self._spans if s[6] in self._threads]
        split = split_steps(steps, blocking)
        if self.warmup_steps == "auto":
            warm, later, rule = warmup([s["step_s"] for s in split], getattr(self, "compiled", False))
        else:
            warm = min(int(self.warmup_steps), max(len(split) - 1, 0))
            rule = [f"the first {warm} step(s) (--profile-warmup-steps {self.warmup_steps})"] if warm else []
            # a recompilation later in the run (a batch of another size: the epoch's short last one)
            # is left out whatever the warm-up count: one took 45 s of a 40-step window and made a
            # 38 ms step read 1,266 ms on an H200 (results/gpu_input/run1.json)
            later = recompilations([s["step_s"] for s in split], warm, getattr(self, "compiled", False))
            if later:
                rule.append(f"{len(later)} later step(s) over {RECOMPILE_FACTOR:g}x the median: recompilations")
        left_out = set(later)
        timed = [s for i, s in enumerate(split) if i >= warm and i not in left_out]
        mean = {k: (sum(s[k] for s in timed) / len(timed) if timed else None) for k in (*PARTS, "other_s", "step_s")}
        parts = sum(mean[k] for k in PARTS) if timed else None
        mine = {"rank": runtime.rank(), "role": self.synced.role, "timed_steps": len(timed), "warmup_steps": warm,
                "left_out": {"steps": [s["step"] for s in split[:warm]] + [split[i]["step"] for i in later],
                             "step_s": [s["step_s"] for s in split[:warm]] + [split[i]["step_s"] for i in later],
                             "rule": rule},
                "first_step_s": split[0]["step_s"] if split else None,
                "split_s": {k: mean[k] for k in PARTS}, "other_s": mean["other_s"], "split_sum_s": parts,
                "step_time_s": mean["step_s"],
                "step_time_median_s": statistics.median(s["step_s"] for s in timed) if timed else None,
                "step_time_min_s": min(s["step_s"] for s in timed) if timed else None,
                "cpu_per_step_s": self._cpu_per_step(warm),
                "split_sum_pct": 100 * parts / mean["step_s"] if timed and mean["step_s"] else None,
                "busy_per_step_s": [s["data_s"] + s["compute_s"] + s["optimizer_s"] for s in timed],
                "window_s": [steps[warm]["begin_s"], steps[-1]["wall_end_s"]] if steps else None}
        if self.gpu is not None:
            self._use_gpu_split(mine, {s["step"] for s in timed})
        if self.trace_path:
            mine["trace"] = {"steps": steps, "comm": [s[:6] for s in self._spans], "buckets": self._buckets}
        return mine

    def _use_gpu_split(self, mine: dict, kept: set) -> None:
        """The GPU's split becomes the rank's ``split_s``; the host's moves to ``host_split_s``."""
        timed = [s for s in self.gpu.close() if s["step"] in kept]
        mine["host_split_s"], mine["host_split_sum_pct"] = mine["split_s"], mine["split_sum_pct"]
        mine["split_clock"] = "cuda events on the training stream"
        if not timed:
            return
        mean = {k: sum(s[k] for s in timed) / len(timed) for k in (*PARTS, "step_s")}
        mine["split_s"] = {k: mean[k] for k in PARTS}
        mine["split_sum_s"] = sum(mean[k] for k in PARTS)
        mine["gpu_step_time_s"] = mean["step_s"]
        mine["split_sum_pct"] = 100 * mine["split_sum_s"] / mine["step_time_s"] if mine["step_time_s"] else None
        mine["busy_per_step_s"] = [s["data_s"] + s["compute_s"] + s["optimizer_s"] for s in timed]

    def _cpu_per_step(self, warm: int) -> float | None:
        """CPU seconds of this process per step after the warm-up (epoch ends included)."""
        cpu = self._cpu_ends
        if warm < 1 or len(cpu) <= warm:
            return (cpu[-1] - cpu[0]) / (len(cpu) - 1) if len(cpu) > 1 else None
        return (cpu[-1] - cpu[warm - 1]) / (len(cpu) - warm)

    def on_train_end(self, record, state):
        for h in self._hooks:
            h.remove()
        traffic.remove_hook(self._on_span)
        monitored = self.monitor.stop() if self.monitor else None
        mine = self.summary()
        if monitored is not None:
            mine["monitor"] = monitored
        everyone = _gather(mine)
        if runtime.rank() == 0:
            self._finish(record, everyone, state.config)

    def _finish(self, record: dict, everyone: list[dict], config) -> None:
        offsets = self.clock["offsets_s"]

        def rel(rank, t):  # a rank's clock reading -> seconds since rank 0's start, on rank 0's clock
            return t - (offsets[rank] if rank < len(offsets) else 0.0) - self.origin_s

        workers = [r for r in everyone if r["role"] == "worker" and r["step_time_s"]]
        step_time = max((r["step_time_s"] for r in workers), default=None)
        straggler = straggler_summary({r["rank"]: r["split_s"] for r in workers if r["timed_steps"]},
                                      {r["rank"]: r["busy_per_step_s"] for r in workers if r["timed_steps"]})
        profile = {"warmup_steps": self.warmup_steps, "clock": self.clock, "step_time_s": step_time,
                   "samples_per_s": len(workers) * self.batch_size / step_time if step_time else None,
                   "samples_per_step": len(workers) * self.batch_size, "gradient_bytes": self.gradient_bytes,
                   "straggler": straggler,
                   "ranks": [{k: v for k, v in r.items() if k not in ("trace", "monitor", "busy_per_step_s")}
                             | {"window_s": [rel(r["rank"], t) for t in r["window_s"]] if r["window_s"] else None}
                             for r in everyone],
                   "trace": str(self.trace_path) if self.trace_path else None, "notes": [self.ddp_note] if self.ddp_note else []}
        profile["steady"] = steady_line(workers, step_time, profile["samples_per_s"], getattr(config, "data", ""))
        record["profile"] = profile
        if self.monitor_on:
            ranks = []
            for r in everyone:
                m = dict(r["monitor"])
                m["samples"] = dict(m["samples"], t_s=[rel(r["rank"], t) for t in m["samples"]["t_s"]])
                ranks.append({"rank": r["rank"], "role": r["role"], **m})
            record["monitor"] = {"clock": "seconds since rank 0 started training, on rank 0's clock", "ranks": ranks}
        if self.trace_path:
            trace = chrome_trace([{"rank": r["rank"], "role": r["role"], **r["trace"]} for r in everyone], offsets,
                                 {"straggler": straggler.get("text"), "strategy": config.strategy})
            files.write_json(self.trace_path, trace)
        if not config.quiet:
            runtime.print0(f"# profile: {profile['steady']}")
            runtime.print0(f"# profile: {straggler.get('text')}")
            if self.trace_path:
                runtime.print0(f"# trace: {self.trace_path} (open in ui.perfetto.dev or chrome://tracing)")


def steady_line(workers: list[dict], step_time: float | None, samples_per_s: float | None, data: str) -> str:
    """``steady step 36.6 ms (6986 samples/s): data wait 0.3 ms (1 %), compute ...; left out: ...`` for rank 0's
    summary, from the slowest worker; names the input pipeline when its wait is a large share of the step."""
    if not workers or not step_time:
        return "no steady steps were timed"
    r = max(workers, key=lambda w: w["step_time_s"])
    split = r["split_s"]
    parts = ", ".join(f"{name[:-2].replace('_', ' ')} {1e3 * split[name]:.1f} ms" for name in PARTS
                      if split.get(name) is not None)
    data_share = (split.get("data_s") or 0.0) / step_time
    text = (f"steady step {1e3 * step_time:.1f} ms ({samples_per_s:.0f} samples/s) over {r['timed_steps']} steps: "
            f"{parts}; data wait {100 * data_share:.0f} % of the step")
    left = r.get("left_out") or {}
    if left.get("steps"):
        text += (f"; left out: {len(left['steps'])} warm-up step(s), the first {r['first_step_s']:.1f} s "
                 f"({'; '.join(left['rule'])})")
    if data_share > DATA_BOUND_SHARE:
        text += (f"; the input pipeline limits this run: `ddtrain bench data --data {data or 'SPEC'}` measures it "
                 f"alone (docs/DATA.md)")
    return text


def _wall_minus_perf() -> float:
    """time.time() - time.perf_counter(), read tightly (traffic spans use the wall clock)."""
    best = None
    for _ in range(5):
        a = time.perf_counter()
        w = time.time()
        b = time.perf_counter()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) / 2)
    return best[1]


def _gather(mine: dict) -> list[dict]:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, out, dst=0)
    return out
