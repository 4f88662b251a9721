"""``ddtrain cluster probe``: point-to-point rate between the ranks of an emulated cluster (run it inside
``ddtrain cluster run``)."""
from __future__ import annotations

from ddtrain.cluster.probe import MODES, run_probe


def add_arguments(parser) -> None:
    parser.add_argument("--modes", default="send", help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--bytes", type=int, default=25_000_000, help="bytes per transfer (per sender)")
    parser.add_argument("--repeat", type=int, default=3, help="timed transfers per mode")
    parser.add_argument("--json", action="store_true", help="also print one JSON line per mode")


def main(args) -> int:
    return run_probe([m for m in args.modes.split(",") if m], args.bytes, args.repeat, args.json)
