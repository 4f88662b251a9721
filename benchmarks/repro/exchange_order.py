"""Does the order of posting a send and a receive change what a Gloo exchange gets from a link?

    sudo ddtrain cluster run --nodes 2 --link 200mbit -- python benchmarks/repro/exchange_order.py
    sudo ddtrain cluster run --nodes 4 --link 200mbit -- python benchmarks/repro/exchange_order.py --bytes 8000000

Every rank swaps BYTES with a peer, both directions at once, posted four ways:
  p2p        ddtrain.comm.p2p.exchange(sends=..., recvs=...), the path every ddtrain algorithm takes
  pg-send1   ProcessGroup.send, then ProcessGroup.recv (what p2p does on Gloo today)
  pg-recv1   ProcessGroup.recv, then ProcessGroup.send
  batch-send1 / batch-recv1   torch.distributed.batch_isend_irecv with the isend / the irecv first
                              (the calibration's pairwise exchange posts the isend first)
and two peer patterns: ``pair`` (0<->1, 2<->3: the same peer both ways, as in a 2-rank ring,
the calibration's exchange and butterfly's steps) and ``ring`` (send to rank+1, receive from
rank-1: the ring's step). Rate = BYTES * 8 / time, per direction, slowest rank, median of
``--repeat``; of_link divides by the cluster's link rate (DDTRAIN_LINK_BPS).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist


def post(mode: str, send: torch.Tensor, recv: torch.Tensor, to: int, frm: int) -> None:
    from ddtrain.comm.p2p import exchange, open_comm, wait

    pg = dist.group.WORLD
    if mode == "p2p":
        comm = open_comm("exchange-order")
        wait(comm, exchange(comm, sends=[(to, send)], recvs=[(frm, recv)]))
    elif mode == "pg-send1":
        works = [pg.send([send], to, 0), pg.recv([recv], frm, 0)]
        for w in works:
            w.wait()
    elif mode == "pg-recv1":
        works = [pg.recv([recv], frm, 0), pg.send([send], to, 0)]
        for w in works:
            w.wait()
    else:
        ops = [dist.P2POp(dist.isend, send, to), dist.P2POp(dist.irecv, recv, frm)]
        if mode == "batch-recv1":
            ops.reverse()
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=int, default=8_000_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--modes", default="p2p,pg-send1,pg-recv1,batch-send1,batch-recv1")
    p.add_argument("--patterns", default="pair,ring")
    p.add_argument("--json", default=None, help="also write the rows as JSON (rank 0)")
    args = p.parse_args(argv)
    from ddtrain.distributed import runtime
    from ddtrain.cluster import link_rate_bps

    runtime.init(backend="gloo")
    rank, world = runtime.rank(), runtime.world_size()
    send = torch.ones(args.bytes // 4)
    recv = torch.empty_like(send)
    link = link_rate_bps()
    rows = []
    for pattern in args.patterns.split(","):
        if pattern == "pair":
            if world % 2:
                continue
            to = frm = rank ^ 1
        else:
            to, frm = (rank + 1) % world, (rank - 1) % world
        for mode in args.modes.split(","):
            post(mode, send[:16], recv[:16], to, frm)          # connections and warm-up
            times = []
            for _ in range(args.repeat):
                dist.barrier()
                t0 = time.perf_counter()
                post(mode, send, recv, to, frm)
                times.append(time.perf_counter() - t0)
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            seconds = statistics.median(t.tolist())
            bps = args.bytes * 8 / seconds
            rows.append({"pattern": pattern, "mode": mode, "ranks": world, "bytes": args.bytes, "time_s": seconds,
                         "Mbit_per_s": bps / 1e6, "of_link": bps / link if link else None})
    if rank == 0:
        print(f"# exchange order: {world} ranks, {args.bytes} B each way per rank, median of {args.repeat}, "
              f"slowest rank; link {link / 1e6 if link else float('nan'):g} Mbit/s", flush=True)
        print(f"# {'pattern':>7} {'mode':>12} {'time_s':>8} {'Mbit/s':>9} {'of_link':>8}", flush=True)
        for r in rows:
            frac = f"{r['of_link']:8.3f}" if r["of_link"] else f"{'':8}"
            print(f"  {r['pattern']:>7} {r['mode']:>12} {r['time_s']:8.4f} {r['Mbit_per_s']:9.2f} {frac}", flush=True)
        if args.json:
            from ddtrain.observe.files import write_json
            write_json(args.json, {"rows": rows, "link_bps": link})
        else:
            print("exchange_order_json " + json.dumps(rows), flush=True)
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
