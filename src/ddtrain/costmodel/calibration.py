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
- **The classic ping-pong** (rank 0 sends, rank 1 answers, everyone else idle; one-way time
  = round trip / 2) is measured too and fitted the same way, for reference: the gap
  between the two fits is the contention the collectives pay.
- **γ**: every rank times ``a.add_(b)`` over buffers of m bytes at the same time (so the
  cores are as shared as during a collective); γ is the slope of the fitted line.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ..errors import DDTrainError
from .alphabeta import LinkParams

DEFAULT_MAX_BYTES = 16 << 20
REDUCE_MIN_BYTES = 16 << 10


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
    exchange: Fit | None          # the fit behind params.alpha_s / beta_s_per_byte
    pingpong: Fit | None          # reference only
    reduce: Fit                   # slope = params.gamma_s_per_byte
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"params": self.params.as_dict(), "world_size": self.world_size,
                "exchange": self.exchange and self.exchange.as_dict(),
                "pingpong": self.pingpong and self.pingpong.as_dict(),
                "reduce": self.reduce.as_dict(), "elapsed_s": self.elapsed_s, "notes": self.notes}


def calibration_sizes(max_bytes: int = DEFAULT_MAX_BYTES, element_size: int = 4) -> list[int]:
    """Message sizes for the fit: ×4 steps from one element up to ``max_bytes``."""
    sizes, m = [], element_size
    while m <= max(max_bytes, element_size):
        sizes.append(m)
        m *= 4
    return sizes


def fit_line(sizes, times) -> tuple[float, float, float]:
    """(α, β, max relative residual) of t = α + βm, least squares on relative errors, α, β ≥ 0."""
    m = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if len(m) < 2 or np.any(t <= 0):
        raise DDTrainError(f"cannot fit a line to sizes {list(sizes)} and times {list(times)}")
    design = np.stack([1 / t, m / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if beta <= 0:   # flat data: all latency
        alpha, beta = float(np.median(t)), 0.0
    elif alpha < 0:  # refit through the origin: all bandwidth
        alpha, beta = 0.0, float(np.sum(m / t) / np.sum((m / t) ** 2))
    predicted = alpha + beta * m
    return float(alpha), float(beta), float(np.max(np.abs(predicted - t) / t))


def calibrate(group=None, *, max_bytes: int = DEFAULT_MAX_BYTES, budget_s: float = 3.0,
              device: torch.device | str = "cpu", pingpong: bool = True) -> Calibration:
    """Measure and fit α, β (exchange), γ (local add) on ``group``; call on all its ranks."""
    start = time.perf_counter()
    device = torch.device(device)
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    sizes = calibration_sizes(max_bytes)
    per_size_s = budget_s / (2 * len(sizes) + 2)
    exchange = ping = None
    notes = []
    if world > 1:
        rank = dist.get_rank(group)
        partner = rank ^ 1
        peer = dist.get_global_rank(group, partner) if partner < world and group is not None else partner
        active = partner < world
        times = [_time_exchange(m, peer if active else None, group, device, per_size_s) for m in sizes]
        exchange = _fit(sizes, _agree_max(times, group, device))
        if pingpong:
            times = [_time_pingpong(m, rank, group, device, per_size_s) for m in sizes]
            ping = _fit(sizes, _agree_max(times, group, device))
    else:
        notes.append("world size 1: no messages to time; alpha = beta = 0")
    # Adds are cheap: time them up to at least 1 MiB whatever the message range.
    reduce_sizes = [m for m in calibration_sizes(max(max_bytes, 1 << 20)) if m >= REDUCE_MIN_BYTES]
    times = [_time_add(m, device, per_size_s) for m in reduce_sizes]
    if world > 1:
        times = _agree_max(times, group, device)
    reduce = _fit(reduce_sizes, times)
    params = LinkParams(alpha_s=exchange.alpha_s if exchange else 0.0,
                        beta_s_per_byte=exchange.beta_s_per_byte if exchange else 0.0,
                        gamma_s_per_byte=reduce.beta_s_per_byte)
    return Calibration(params=params, world_size=world, exchange=exchange, pingpong=ping,
                       reduce=reduce, elapsed_s=time.perf_counter() - start, notes=notes)


def _fit(sizes, times) -> Fit:
    alpha, beta, residual = fit_line(sizes, times)
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


def _time_exchange(nbytes: int, peer, group, device, per_size_s) -> float:
    send = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)

    def step():
        if peer is None:
            return
        ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    dist.barrier(group)
    return _timed_chains(step, device, per_size_s, group, distributed=True)


def _time_pingpong(nbytes: int, rank: int, group, device, per_size_s) -> float:
    """One-way time between group ranks 0 and 1 (round trip / 2); 0 on the idle ranks."""
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    first, second = (dist.get_global_rank(group, r) if group is not None else r for r in (0, 1))

    def step():
        if rank == 0:
            dist.send(buf, second, group)
            dist.recv(buf, second, group)
        elif rank == 1:
            dist.recv(buf, first, group)
            dist.send(buf, first, group)

    dist.barrier(group)
    return _timed_chains(step, device, per_size_s, group, distributed=True) / 2


def _time_add(nbytes: int, device, per_size_s) -> float:
    a = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    b = torch.ones_like(a)
    return _timed_chains(lambda: a.add_(b), device, per_size_s)


def _agree_max(values, group, device) -> list[float]:
    """Element-wise maximum over the group's ranks (the slowest rank sets a collective's pace)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return list(values)
    backend_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor(list(values), dtype=torch.float64, device=backend_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()
