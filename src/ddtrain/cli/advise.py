"""``ddtrain advise``: predict, rank and choose a strategy × compression × algorithm for a model on a link.

    ddtrain advise --model resnet18 --data cifar10 --workers 4 --batch-size 32 --step-time 0.40 \\
        --link-rate 100mbit --latency 2ms --burst emulated
    ddtrain advise --params 25_600_000 --workers 8 --measure --link-rate 1gbit --latency 0.2ms --json -
    ddtrain advise --model resnet18 --workers 4 --step-time 0.4 --calibration results/advise/loaded_100mbit.json

Pure prediction, no processes: ``ddtrain.bench.advise`` checks the inputs, measures what is asked
and renders the table, ``ddtrain.costmodel.advise`` predicts and ranks (docs/ADVISE.md says how it
predicts and how far it is from measurement). The table is ranked by predicted step time; the
first choice is the fastest whose accuracy risk is known to be within ``--risk-bound`` points.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

# the request alone (no torch): --help answers at once; the prediction is imported by main
from ddtrain.bench.advice_request import DEFAULT_COMPRESSIONS, DEFAULT_INTERVALS, AdviceRequest
from ddtrain.errors import DDTrainError


def add_arguments(parser) -> None:
    what = parser.add_argument_group("the model (one of --model or --params)")
    what.add_argument("--model", help="a model of the zoo (ddtrain.models.MODELS): its parameter shapes")
    what.add_argument("--params", help="the parameter count instead of a model (shapes unknown: one square "
                                       "matrix is assumed for PowerSGD)")
    what.add_argument("--data", default="cifar10", help="input shape and classes of --model: mnist, cifar10 or "
                                                        "imagenet (ddtrain.data.synthetic.SHAPES)")
    run = parser.add_argument_group("the run")
    run.add_argument("--workers", type=int, required=True, help="training ranks")
    run.add_argument("--batch-size", type=int, default=32, help="samples per step on each worker")
    run.add_argument("--procs-per-node", type=int, default=1, help="ranks sharing one node (its link)")
    run.add_argument("--step-time", help="measured compute step (forward+backward+optimizer, no communication), "
                                         "e.g. 0.4 or 400ms")
    run.add_argument("--measure", action="store_true", help="time a few steps of --model here (one thread) instead of "
                                                            "--step-time")
    run.add_argument("--backward-share", type=float, help="the part of the compute step that is the backward pass, "
                     "which bucket communication overlaps (default 2/3: backward ~ 2x forward, the FLOP rule)")
    run.add_argument("--host-cores", type=int, help="cores the ranks of one host share (with --ranks-per-host: the "
                                                    "work measured here on one thread slows down by ranks / cores)")
    run.add_argument("--ranks-per-host", type=int, help="ranks sharing --host-cores (every rank in the emulated cluster)")
    run.add_argument("--cpu-factor", type=float, help="how much slower work timed here on one thread runs in the job "
                                                      "(measured: compute step in the job / here); overrides "
                                                      "--host-cores/--ranks-per-host")
    link = parser.add_argument_group("the link (--link-rate, or --calibration)")
    link.add_argument("--link-rate", help="each node's link rate in tc's bit units, e.g. 100mbit, 1gbit")
    link.add_argument("--latency", default="0.2ms", help="α: seconds one collective step pays besides its bytes "
                                                        "(under load: see docs/ADVISE.md), e.g. 0.2ms, 2ms")
    link.add_argument("--burst", default="0", help="token-bucket burst in bytes of a rate-limited link, or "
                                                   "'emulated' for ddtrain cluster run's tbf (0: none)")
    run.add_argument("--codec-times", metavar="FILE", help="JSON with codec_s: {compression: seconds per step} of "
                                                           "the compressors' own work measured where the job runs "
                                                           "(experiments/advise_check.py writes one); used as is")
    link.add_argument("--calibration", help="a JSON file with alpha_s and beta_s_per_byte (a loaded fit written "
                                            "by experiments/advise_check.py, or a bench collectives --json)")
    choice = parser.add_argument_group("the choices")
    choice.add_argument("--strategies", help="strategies to compare (default: every one the model predicts)")
    choice.add_argument("--compressions", default=DEFAULT_COMPRESSIONS, help="gradient compressions to compare")
    choice.add_argument("--sync-every", default=DEFAULT_INTERVALS, help="intervals to compare for averaging strategies")
    choice.add_argument("--risk-bound", type=float, default=1.0, help="accuracy points the first choice may cost")
    choice.add_argument("--top", type=int, default=None, help="rows to print, at least 1 (default: all)")
    parser.add_argument("--json", metavar="FILE", help="also write the advice as JSON to FILE ('-': stdout only); "
                                                       "an existing FILE is kept unless --force")
    parser.add_argument("--force", action="store_true", help="with --json FILE: replace FILE if it exists")


def request_of(args):
    """The parsed flags as the library's ``AdviceRequest`` (its fields are the flags)."""
    return AdviceRequest(**{f.name: getattr(args, f.name) for f in dataclasses.fields(AdviceRequest)})


def check_output(path: str | None, force: bool) -> None:
    """--json FILE checked before anything is measured: a folder, a parent that is a file, or an existing FILE
    without --force is one line (issue 32: a traceback, or the file silently replaced)."""
    if not path or path == "-":
        return
    target = Path(path)
    if target.is_dir():
        raise DDTrainError(f"--json {path}: is a directory; give a file name")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise DDTrainError(f"--json {path}: {parent} is not a directory")
    if target.exists() and not force:
        raise DDTrainError(f"--json {path}: the file exists; give --force to replace it, or another name")


def main(args) -> int:
    if args.top is not None and args.top < 1:   # --top -1 dropped the last row without a word (issue 32)
        raise DDTrainError(f"--top must be at least 1 (leave it out for every row), got {args.top}")
    check_output(args.json, args.force)
    from ddtrain.bench.advise import build_advice, render
    advice = build_advice(request_of(args))
    advice.pop("predictions")
    if args.json == "-":
        print(json.dumps(advice, indent=2))
        return 0
    print(render(advice, args.top))
    if args.json:
        from ddtrain.observe.files import write_json
        write_json(args.json, advice, what="the advice")
    return 0
