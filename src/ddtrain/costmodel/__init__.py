"""Cost model of communication: what the documents count, and what an all-reduce should take.

- ``counts``: document 000's communications per epoch (Table 5.1) for the centralized,
  decentralized and proposed methods, exact for any N, R, E;
- ``alphabeta``: α-β-γ predicted time of one all-reduce for every algorithm in
  ``ddtrain.comm`` (``PREDICTORS``, ``predict_time``);
- ``calibration``: α, β and γ fitted from point-to-point timings on the current group;
- ``advise``: predicted step time and bytes of every strategy × compression × algorithm, ranked
  with each one's accuracy risk (``risks``), over what the plain model misses: α under load fitted
  to collectives inside training (``loaded``), the emulated links' token bucket (``burst``), ranks
  sharing a host (``contention``), each algorithm's messages step by step and its use of a shared
  link, read from its record in ``ddtrain.comm.ALGORITHMS`` (``schedule``), DDP's buckets
  overlapping the backward pass (``overlap``). The adviser's inputs and measurements are
  ``ddtrain.bench.advise``'s.
"""
from __future__ import annotations

from ddtrain.costmodel.alphabeta import (PREDICTORS, LinkParams, bus_bandwidth_factor, butterfly_time, central_time,
                        native_time, predict_time, ring_async_time, ring_time, tree_time)
from ddtrain.costmodel.counts import (METHODS, CountRow, centralized_count, count_table, decentralized_count,
                     format_count, proposed_count)


def calibrate(group=None, **kwargs):
    """Fit α, β, γ on ``group`` (see ``ddtrain.costmodel.calibration``); call on all its ranks."""
    from ddtrain.costmodel.calibration import calibrate as _calibrate
    return _calibrate(group, **kwargs)


__all__ = ["PREDICTORS", "LinkParams", "bus_bandwidth_factor", "butterfly_time", "central_time",
           "native_time", "predict_time", "ring_async_time", "ring_time", "tree_time", "METHODS",
           "CountRow", "centralized_count", "count_table", "decentralized_count", "format_count",
           "proposed_count", "calibrate"]
