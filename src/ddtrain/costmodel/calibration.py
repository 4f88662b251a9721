"""Fit α, β and γ of the current process group from point-to-point timings.

Call ``calibrate()`` on every rank of the group at once; every rank gets the same result.

- **α, β: pairwise exchange ("bidirectional ping-pong").** Ranks pair up (0↔1, 2↔3, …; an
  odd one out idles) and every pair swaps a message of m bytes at the same time through
  ``batch_isend_irecv``, several times back to back. That is the step every all-reduce
  algorithm is made of (each rank sends and receives at once, all ranks busy), so its cost
  includes the contention of all ranks sharing the machine, which a lone ping-pong between
  two otherwise idle ranks does not see. Per size: the median over repetitions of
  (chain time / exchanges in the chain), then the maximum over ranks. A least-squares line
  ``t(m) = α + βm`` is fitted with relative residuals, so 8-byte and 16-MB points weigh alike.
- **References** (not used by the predictions): the *ring-neighbour exchange* (every rank
  sends to rank+1 while receiving from rank−1: the ring's step, in which all ranks depend
  on each other) and the *classic ping-pong* (ranks 0 and 1 alone, one direction at a time;
  one-way time = round trip / 2). The gaps between the three fits are the costs of the
  pattern and of contention, which the plain α-β model does not have terms for.
- **γ**: every rank times ``a.add_(b)`` at the same time (the cores as shared as during a
  collective) over buffers from 256 KiB up, which do not stay in cache; γ is the slope of
  the plain least-squares line. ``a.copy_(b)`` is timed the same way, for reference: the
  memory bandwidth that bounds a loopback transfer, which is copies too.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ddtrain.errors import DDTrainError
from ddtrain.costmodel.alphabeta import LinkParams

DEFAULT_MAX_BYTES = 16 << 20
REDUCE_MIN_BYTES = 256 << 10


@dataclass(kw_only=True)
class Fit:
    """A line t = α + βm through median times, and the points it was fitted to."""

    alpha_s: float
    beta_s_per_byte: float
    sizes: list[int]
    times_s: list[float]
    max_rel_residual: float

    def as_dict(self) -> dict:
        return {"alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte,
                "sizes": self.sizes, "times_s": self.times_s,
                "max_rel_residual": self.max_rel_residual}


@dataclass(kw_only=True)
class Calibration:
    """What ``calibrate`` measured; ``params`` is what the predictions use."""

    params: LinkParams
    world_size: int
    exchange: Fit | None          # pairwise exchange: the fit behind params.alpha_s, beta_s_per_byte
    ring: Fit | None = None       # reference: every rank sends right and receives from the left
    pingpong: Fit | None = None   # reference: ranks 0 and 1 alone, one direction at a time
    reduce: Fit                   # slope = params.gamma_s_per_byte
    copy: Fit | None = None       # reference: a local copy (memory bandwidth), timed like the adds
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"params": self.params.as_dict(), "world_size": self.world_size,
                "exchange": self.exchange and self.exchange.as_dict(),
                "ring": self.ring and self.ring.as_dict(),
                "pingpong": self.pingpong and self.pingpong.as_dict(),
                "reduce": self.reduce.as_dict(), "copy": self.copy and self.copy.as_dict(),
                "elapsed_s": self.elapsed_s, "notes": self.notes}


def calibration_sizes(max_bytes: int = DEFAULT_MAX_BYTES, element_size: int = 4) -> list[int]:
    """Message sizes for the fit: ×4 steps from one element up to ``max_bytes``."""
    sizes, m = [], element_size
    while m <= max(max_bytes, element_size):
        sizes.append(m)
        m *= 4
    return sizes


def fit_line(sizes, times, relative: bool = True) -> tuple[float, float, float]:
    """(α, β, max relative residual) of t = α + βm by least squares, with α, β ≥ 0.

    With ``relative`` residuals (each point weighted by 1/t) the latency-bound small sizes fix
    α and the bandwidth-bound large ones fix β. If noise on the small sizes tips β below zero
    (or without ``relative``), the plain least-squares line, ruled by the large sizes, is used;
    if even that does not rise, β is 0 (no measurable cost per byte at these sizes) and α is
    the median time.
    """
    m = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if len(m) < 2 or np.any(t <= 0):
        raise DDTrainError(f"cannot fit a line to sizes {list(sizes)} and times {list(times)}")
    ones = np.ones_like(t)
    beta = 0.0
    if relative:
        (alpha, beta), *_ = np.linalg.lstsq(np.stack([ones / t, m / t], axis=1), ones, rcond=None)
    if beta <= 0:
        (alpha, beta), *_ = np.linalg.lstsq(np.stack([ones, m], axis=1), t, rcond=None)
    if beta <= 0:
        alpha, beta = float(np.median(t)), 0.0
    elif alpha < 0:  # refit through the origin (same weighting): all bandwidth
        alpha = 0.0
        beta = float(np.sum(m / t) / np.sum((m / t) ** 2)) if relative else float(np.sum(m * t) / np.sum(m * m))
    predicted = alpha + beta * m
    return float(alpha), float(beta), float(np.max(np.abs(predicted - t) / t))


def calibrate(group=None, *, max_bytes: int = DEFAULT_MAX_BYTES, budget_s: float = 4.0,
              device: torch.device | str = "cpu", references: bool = True) -> Calibration:
    """Measure and fit α, β (pairwise exchange) and γ (local add) on ``group``; call on all its ranks.

    With ``references`` the ring-neighbour exchange and the lone ping-pong are fitted too (not
    used by the predictions; they show how much the pattern and the contention matter).
    """
    start = time.perf_counter()
    device = torch.device(device)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    sizes = calibration_sizes(max_bytes)
    per_size_s = budget_s / (4 * len(sizes))
    fits: dict[str, Fit] = {}
    notes = []
    if world > 1:
        rank, glob = dist.get_rank(group), _global_rank(group)
        pair = _pair_peers(group)
        ring = (glob((rank + 1) % world), glob((rank - 1) % world))
        patterns = {"exchange": lambda m: _time_exchange(m, pair, group, device, per_size_s)}
        if references:
            patterns["ring"] = lambda m: _time_exchange(m, ring, group, device, per_size_s)
            patterns["pingpong"] = lambda m: _time_pingpong(m, rank, glob, group, device, per_size_s)
        for name, measure in patterns.items():
            fits[name] = _fit(sizes, _agree_max([measure(m) for m in sizes], group, device))
    else:
        notes.append("world size 1: no messages to time; alpha = beta = 0")
    # The reduction term matters for large buffers, which do not fit in cache: time adds from
    # 256 KiB to at least 4 MiB and fit plain least squares, which the large sizes rule.
    reduce_sizes = [m for m in calibration_sizes(max(max_bytes, 4 << 20)) if m >= REDUCE_MIN_BYTES]
    times = _agree_max([_time_local(m, "add", device, per_size_s) for m in reduce_sizes], group, device)
    reduce = _fit(reduce_sizes, times, relative=False)
    copy = None
    if references:
        times = _agree_max([_time_local(m, "copy", device, per_size_s) for m in reduce_sizes], group, device)
        copy = _fit(reduce_sizes, times, relative=False)
    exchange = fits.get("exchange")
    params = LinkParams(alpha_s=exchange.alpha_s if exchange else 0.0,
                        beta_s_per_byte=exchange.beta_s_per_byte if exchange else 0.0,
                        gamma_s_per_byte=reduce.beta_s_per_byte)
    return Calibration(params=params, world_size=world, exchange=exchange, ring=fits.get("ring"),
                       pingpong=fits.get("pingpong"), reduce=reduce, copy=copy,
                       elapsed_s=time.perf_counter() - start, notes=notes)


def exchange_time(nbytes: int, group=None, *, device: torch.device | str = "cpu", budget_s: float = 0.5) -> float:
    """Seconds of one pairwise exchange of ``nbytes`` (median, slowest rank); call on all ranks.

    The same measurement as the calibration's; timed again later it shows how much the
    machine's load moved in between.
    """
    device = torch.device(device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 0.0
    seconds = _time_exchange(nbytes, _pair_peers(group), group, device, budget_s)
    return _agree_max([seconds], group, device)[0]


def _global_rank(group):
    return (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)


def _pair_peers(group):
    """(send peer, receive peer) of this rank in the pairwise exchange; None for the odd one out."""
    partner = dist.get_rank(group) ^ 1
    if partner >= dist.get_world_size(group):
        return None
    peer = _global_rank(group)(partner)
    return peer, peer


def _fit(sizes, times, relative: bool = True) -> Fit:
    alpha, beta, residual = fit_line(sizes, times, relative=relative)
    return Fit(alpha_s=alpha, beta_s_per_byte=beta, sizes=list(sizes), times_s=list(times),
               max_rel_residual=residual)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _repeat_plan(seconds_per_call: float, per_size_s: float) -> tuple[int, int]:
    """(calls per chain, chains) that fit the time budget: at least 1 × 3."""
    calls = int(min(16, max(1, per_size_s / 8 / max(seconds_per_call, 1e-7))))
    chains = int(min(9, max(3, per_size_s / max(seconds_per_call * calls, 1e-7))))
    return calls, chains


def _timed_chains(step, device, per_size_s, group=None, distributed=False) -> float:
    """Median seconds per ``step()`` over chains of back-to-back calls, after one untimed call.

    With ``distributed`` the chain plan comes from the slowest rank's probe, so every rank
    runs the same number of steps (else some sends would go unanswered).
    """
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    probe = time.perf_counter() - t0
    if distributed:
        probe = _agree_max([probe], group, device)[0]
    calls, chains = _repeat_plan(probe, per_size_s)
    samples = []
    for _ in range(chains):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        _sync(device)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def _time_exchange(nbytes: int, peers, group, device, per_size_s) -> float:
    """Seconds per step of sending ``nbytes`` to ``peers[0]`` while receiving from ``peers[1]``."""
    send = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)

    def step():
        if peers is None:  # the odd rank out
            return
        # receive posted first: Gloo halves a pairwise exchange whose send goes first
        ops = [dist.P2POp(dist.irecv, recv, peers[1], group), dist.P2POp(dist.isend, send, peers[0], group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    dist.barrier(group)
    return _timed_chains(step, device, per_size_s, group, distributed=True)


def _time_pingpong(nbytes: int, rank: int, glob, group, device, per_size_s) -> float:
    """One-way time between group ranks 0 and 1 (round trip / 2); 0 on the idle ranks."""
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    first, second = glob(0), glob(1)

    def step():
        if rank == 0:
            dist.send(buf, second, group)
            dist.recv(buf, second, group)
        elif rank == 1:
            dist.recv(buf, first, group)
            dist.send(buf, first, group)

    dist.barrier(group)
    return _timed_chains(step, device, per_size_s, group, distributed=True) / 2


def _time_local(nbytes: int, what: str, device, per_size_s) -> float:
    """Seconds for ``a.add_(b)`` or ``a.copy_(b)`` over float32 buffers of ``nbytes``."""
    a = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    b = torch.ones_like(a)
    step = (lambda: a.add_(b)) if what == "add" else (lambda: a.copy_(b))
    return _timed_chains(step, device, per_size_s)


def _agree_max(values, group, device) -> list[float]:
    """Element-wise maximum over the group's ranks (the slowest rank sets a collective's pace)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return list(values)
    backend_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor(list(values), dtype=torch.float64, device=backend_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()
