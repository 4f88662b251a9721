"""The step split as the GPU lives it: CUDA events on the training stream, not host clock reads.

On a GPU the host runs ahead of the device and blocks only where something forces a
synchronisation (a ``.item()`` for the progress line, a full queue), so host clock readings
measure where the host waited, not where the GPU spent its time: on 4 H200s the host split
gave rank 0 a 33.8 ms "data wait" for data that never left the GPU (issue 20). Here every phase
boundary is an event recorded on the current (training) stream; the GPU reaches an event when
it has finished all the work enqueued before it, so the time between two events is GPU time:

* data wait: from the end of the previous step to the batch being ready (gather kernels,
  unfinished copies, or an idle GPU while the host is still producing the batch);
* compute: forward and backward, up to the last gradient (an event in the hook of the
  parameter whose gradient arrives last, found on the first step);
* communication wait: from the last gradient to the optimizer (DDP's all-reduce the stream
  waits for) plus the strategy's exchange after the optimizer (parameter servers, averaging);
* optimizer: between the optimizer's step pre- and post-hooks.

They tile the GPU step exactly. Events are read lazily (``query()``, never a synchronisation)
and turned into seconds as soon as a step's last event is done, so a long run keeps no
backlog. docs/PERFORMANCE.md, "The step split on GPUs", defines the figures.
"""
from __future__ import annotations

import collections

import torch

PARTS = ("data_s", "compute_s", "comm_wait_s", "optimizer_s")


class GpuStepEvents:
    """Records the phase events of every step of one rank and keeps their per-step split."""

    def __init__(self, model: torch.nn.Module, optimizer, device: torch.device):
        self.device = device
        self._pending: collections.deque = collections.deque()
        self.steps: list[dict] = []          # {"step", data_s, compute_s, comm_wait_s, optimizer_s, step_s}
        self._current: dict | None = None
        self._last_end = None                # the event the next step's data wait starts from
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._order: list[int] = []          # gradient arrival order, learnt on the first step
        self._last_index = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook(i)) for i, p in enumerate(self._params)]
        self._opt_hooks = []
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, torch.optim.Optimizer):
            self._opt_hooks = [inner.register_step_pre_hook(lambda *_: self._record("opt_begin")),
                               inner.register_step_post_hook(lambda *_: self._record("opt_end"))]

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _record(self, name: str) -> None:
        if self._current is not None:
            self._current[name] = self._event()

    def _grad_hook(self, index: int):
        def hook(_param):
            if self._last_index is None:          # first step: learn the order (host clock only)
                self._order.append(index)
            elif index == self._last_index:
                self._record("grads_done")
        return hook

    def epoch_begin(self) -> None:
        self._last_end = self._event()

    def step_begin(self, step: int) -> None:
        """Called once the loop holds the step's batch: the data wait ends here."""
        if self._last_end is None:
            self._last_end = self._event()
        self._current = {"step": step, "begin": self._last_end, "data_end": self._event()}

    def step_end(self) -> None:
        cur, self._current = self._current, None
        if cur is None:
            return
        cur["end"] = self._last_end = self._event()
        if self._last_index is None and self._order:
            self._last_index = self._order[-1]
        self._pending.append(cur)
        self._drain(block=False)

    def _drain(self, block: bool) -> None:
        while self._pending and (block or self._pending[0]["end"].query()):
            cur = self._pending.popleft()
            if block:
                cur["end"].synchronize()
            split = _split(cur)
            if split is not None:
                self.steps.append(split)

    def close(self) -> list[dict]:
        """Every recorded step's split (waits for the GPU to reach the last event), hooks removed."""
        for h in (*self._hooks, *self._opt_hooks):
            h.remove()
        self._drain(block=True)
        return self.steps


def _ms(a, b) -> float:
    return a.elapsed_time(b) / 1e3


def _split(ev: dict) -> dict | None:
    """One step's seconds per part; None when the optimizer did not run (a skipped step)."""
    if "opt_begin" not in ev or "opt_end" not in ev:
        return None
    grads = ev.get("grads_done", ev["opt_begin"])
    data = _ms(ev["begin"], ev["data_end"])
    compute = _ms(ev["data_end"], grads)
    waiting = _ms(grads, ev["opt_begin"]) + _ms(ev["opt_end"], ev["end"])
    optimizer = _ms(ev["opt_begin"], ev["opt_end"])
    if compute < 0:  # the chosen gradient event ran before data_end: an unusual graph; fold it into compute
        compute, waiting = compute + _ms(grads, ev["opt_begin"]), _ms(ev["opt_end"], ev["end"])
    return {"step": ev["step"], "data_s": data, "compute_s": compute, "comm_wait_s": waiting,
            "optimizer_s": optimizer, "step_s": _ms(ev["begin"], ev["end"])}
