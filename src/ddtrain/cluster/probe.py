"""Measure what the emulated links carry, through the process group (Gloo send/recv).

    ddtrain cluster run --nodes 2 --link 200mbit -- python -m ddtrain.cluster.probe
    ddtrain cluster run --nodes 4 --link 200mbit -- python -m ddtrain.cluster.probe --modes send,bidi,incast

Modes (first rank = rank 0 on node 0, last rank = the last rank, on the last node):
  send    first rank sends BYTES to the last rank; rate = BYTES / receive time.
  bidi    first and last rank send BYTES to each other at once (a link is full duplex, so each
          direction should reach the link rate); rate = per direction.
  incast  every rank except the first sends BYTES to the first at once; rate = total received
          by the first rank / time, bounded by the first node's link (a server's, in ps terms).
Each mode runs ``--repeat`` times after a small warm-up exchange; the table shows the median.
``of_link`` divides by the bottleneck link rate (each rank's node and node link rate, which
the cluster exports); it is blank outside ``ddtrain cluster run`` or when both ends share a node.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ddtrain.distributed import runtime
from ddtrain.errors import DDTrainError
from ddtrain.cluster.links import NODE_ENV, link_rate_bps

MODES = ("send", "bidi", "incast")


def _bottleneck_bps(mode: str, where: list) -> int | None:
    """The link rate that bounds ``mode``, from every rank's (node, node link bits/s); None if unknown."""
    (first_node, first_link), (last_node, last_link) = where[0], where[-1]
    if first_link is None:
        return None
    if mode in ("send", "bidi"):
        return None if first_node == last_node else min(first_link, last_link)
    # incast: node 0's link in, or all other nodes' links out, whichever is smaller; senders on
    # node 0 itself never touch a link (use one rank per node for a clean figure)
    others = {node: link for node, link in where if node != first_node}
    return min(first_link, sum(others.values())) if others else None


def _once(mode: str, nbytes: int, world: int, rank: int) -> float | None:
    """Time one transfer; the receiving side returns its rate in bits/s, others None."""
    first, last = 0, world - 1
    payload = torch.ones(nbytes, dtype=torch.uint8)
    inbox = torch.empty(nbytes, dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    if mode == "send":
        if rank == first:
            dist.send(payload, last)
        elif rank == last:
            dist.recv(inbox, first)
            return nbytes * 8 / (time.perf_counter() - start)
    elif mode == "bidi":
        if rank in (first, last):
            peer = last if rank == first else first
            # receive first: on Gloo, an isend posted before the irecv of the same pair holds
            # the irecv back, and the exchange runs one direction at a time (half the rate)
            ops = [dist.P2POp(dist.irecv, inbox, peer), dist.P2POp(dist.isend, payload, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if rank == last:
                return nbytes * 8 / (time.perf_counter() - start)
    elif mode == "incast":
        if rank == first:
            boxes = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(world - 1)]
            works = [dist.irecv(box, src) for src, box in enumerate(boxes, start=1)]
            for work in works:
                work.wait()
            return (world - 1) * nbytes * 8 / (time.perf_counter() - start)
        dist.send(payload, first)
    return None


def run_probe(modes: list[str], nbytes: int, repeat: int, as_json: bool = False) -> int:
    """Time each of ``modes`` ``repeat`` times with ``nbytes`` per transfer; rank 0 prints the table."""
    bad = [m for m in modes if m not in MODES]
    if bad or nbytes < 1 or repeat < 1:
        raise DDTrainError(f"probe: modes must be from {', '.join(MODES)}; --bytes and --repeat positive")
    runtime.init(backend="gloo")
    world, rank = runtime.world_size(), runtime.rank()
    if world < 2:
        raise DDTrainError("probe: needs at least 2 ranks (e.g. --nodes 2)")
    _once("send", 1024, world, rank)  # warm-up: connections are made on first use
    where = [None] * world
    node = os.environ.get(NODE_ENV)
    dist.all_gather_object(where, (int(node) if node else None, link_rate_bps(node=True)))
    if rank == 0:
        print(f"# ddtrain cluster probe: {world} ranks, {nbytes} bytes per transfer, median of {repeat}",
              flush=True)
        print(f"# {'mode':>6} {'bytes':>12} {'time_s':>8} {'Mbit/s':>9} {'of_link':>8}", flush=True)
    for mode in modes:
        rates = [_once(mode, nbytes, world, rank) for _ in range(repeat)]
        # the measuring rank is the last one (send, bidi) or the first (incast); gather to rank 0
        mine = statistics.median(rates) if rates[0] is not None else 0.0
        box = [None] * world
        dist.all_gather_object(box, mine)
        if rank == 0:
            bps = max(box)
            link = _bottleneck_bps(mode, where)
            total = nbytes * (world - 1 if mode == "incast" else 1)
            fraction = f"{bps / link:8.3f}" if link else f"{'':8}"
            print(f"  {mode:>6} {total:>12} {total * 8 / bps:8.4f} {bps / 1e6:9.2f} {fraction}", flush=True)
            if as_json:
                print("probe_result " + json.dumps({"mode": mode, "bytes": total, "bits_per_s": bps,
                                                    "link_bps": link, "of_link": bps / link if link else None}),
                      flush=True)
    runtime.shutdown()
    return 0


if __name__ == "__main__":  # the command is ``ddtrain cluster probe``; this keeps ``python -m`` working
    from ddtrain.cli import main
    sys.exit(main(["cluster", "probe", *sys.argv[1:]]))
