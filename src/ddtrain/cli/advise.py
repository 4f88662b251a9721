"""``ddtrain advise``: predict, rank and choose a strategy × compression × algorithm for a model on a link.

    ddtrain advise --model resnet18 --data cifar10 --workers 4 --batch-size 32 --step-time 0.40 \\
        --link-rate 100mbit --latency 2ms --burst emulated
    ddtrain advise --params 25_600_000 --workers 8 --measure --link-rate 1gbit --latency 0.2ms --json -
    ddtrain advise --model resnet18 --workers 4 --step-time 0.4 --calibration results/advise/loaded_100mbit.json

Pure prediction, no processes: ``ddtrain.costmodel.advise`` (docs/ADVISE.md says how it
predicts and how far it is from measurement). The table is ranked by predicted step time; the
first choice is the fastest whose accuracy risk is known to be within ``--risk-bound`` points.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import time
from pathlib import Path

from ddtrain.errors import DDTrainError

DEFAULT_COMPRESSIONS = "none,fp16,bf16,powersgd:4,topk:0.1"   # topk:0.1 is the fraction our runs measured
DEFAULT_INTERVALS = "4,20"
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}


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
    choice.add_argument("--top", type=int, default=0, help="rows to print (0: all)")
    parser.add_argument("--json", metavar="FILE", help="also write the advice as JSON to FILE ('-': stdout only)")


def parse_seconds(text: str, flag: str) -> float:
    """``"2ms"`` -> 0.002, ``"0.4"`` -> 0.4; a clear error otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(s|ms|us|µs)?\s*", str(text))
    if not match:
        raise DDTrainError(f"{flag}: cannot read {text!r} as a time; write e.g. 0.4, 400ms or 200us")
    value = float(match.group(1)) * _TIME_UNITS[match.group(2) or "s"]
    if not math.isfinite(value):
        raise DDTrainError(f"{flag}: {text!r} is not a finite time")
    return value


def parse_count(text: str, flag: str) -> int:
    try:
        value = int(str(text).replace("_", ""))
    except ValueError:
        raise DDTrainError(f"{flag}: {text!r} is not a whole number") from None
    if value < 1:
        raise DDTrainError(f"{flag}: must be >= 1, got {value}")
    return value


def model_shapes(args) -> tuple[tuple[int, ...], ...]:
    """Gradient shapes of --model (built on the meta device: no memory, no time) or one square matrix for --params."""
    if (args.model is None) == (args.params is None):
        raise DDTrainError("give exactly one of --model NAME or --params N")
    if args.params is not None:
        n = parse_count(args.params, "--params")
        side = math.isqrt(n)
        return ((side, side), (n - side * side,)) if n > side * side else ((side, side),)
    model = build(args)
    return tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)


def build(args, device: str = "meta"):
    import torch

    from ddtrain.data.synthetic import SHAPES
    from ddtrain.models.zoo import build_model
    if args.data not in SHAPES:
        raise DDTrainError(f"--data must be one of {', '.join(SHAPES)}, got {args.data!r}")
    channels, side, classes, _ = SHAPES[args.data]
    with torch.device(device):
        return build_model(args.model, num_classes=classes or 1, in_channels=channels, input_size=(side, side))


class one_thread:
    """Time on one thread: on a shared, loaded host two OpenMP threads spin against each other's load and a
    ResNet-18 step measured 17.4 s on two threads against 2.2 s on one (docs/ADVISE.md)."""

    def __enter__(self):
        import torch
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        import torch
        torch.set_num_threads(self.threads)


def measure_step(args, steps: int = 5) -> float:
    """Median seconds of a forward+backward+SGD step of --model with --batch-size random inputs, here, alone, one thread."""
    with one_thread():
        return _measure_step(args, steps)


def _measure_step(args, steps: int) -> float:
    import torch

    from ddtrain.data.synthetic import SHAPES
    if args.model is None:
        raise DDTrainError("--measure needs --model (there is nothing to time with --params)")
    channels, side, classes, _ = SHAPES[args.data]
    model = build(args, device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch_size, channels, side, side)
    y = torch.randint(0, classes or 1, (args.batch_size,))
    loss_fn = torch.nn.CrossEntropyLoss() if classes else torch.nn.MSELoss()
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        out = model(x)
        loss = loss_fn(out, y) if classes else loss_fn(out, torch.zeros_like(out))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= 2:   # the first steps allocate
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_codecs(specs, shapes, calls: int = 3) -> dict[str, float]:
    """Median seconds of each compressor's own work on a gradient of ``shapes``, here, alone, one thread (no messages).

    The compressor is the one training uses (``ddtrain.comm.compression.build``), past its warm-up,
    on a random buffer: what it adds to a step besides its collectives.
    """
    with one_thread():
        return time_codecs(specs, shapes, calls)


def time_codecs(specs, shapes, calls: int = 3, group=None) -> dict[str, float]:
    """``measure_codecs`` on the threads this process has (the check times them inside the cluster's ranks).

    Inside a job, ``group`` must be a group of this rank alone, so that no message is sent.
    """
    import torch

    from ddtrain.comm import compression
    numel = sum(math.prod(s) for s in shapes)
    out = {}
    for spec in specs:
        compressor = compression.build(spec)
        if compressor is None:
            continue
        for name in ("warmup_steps",):       # PowerSGD: time the compressed steps, not the warm-up's plain ones
            if hasattr(compressor, name):
                compressor.steps = getattr(compressor, name)
        flat = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        times = []
        for i in range(calls + 1):
            buffer = flat.clone()
            start = time.perf_counter()
            compressor.all_reduce_(buffer, shapes, algorithm="ring", group=group, key=0, last=True)
            if i:   # the first call allocates the state (error, P, Q)
                times.append(time.perf_counter() - start)
        out[spec] = statistics.median(times)
    return out


def read_codec_times(path: str, specs) -> dict[str, float]:
    """The codec_s mapping of a --codec-times file, covering every compression compared."""
    file = Path(path)
    if not file.is_file():
        raise DDTrainError(f"--codec-times: no such file {path!r}")
    try:
        codecs = json.loads(file.read_text()).get("codec_s")
    except (json.JSONDecodeError, AttributeError):
        raise DDTrainError(f"--codec-times {path}: not a JSON object with codec_s") from None
    if not isinstance(codecs, dict):
        raise DDTrainError(f"--codec-times {path}: no codec_s mapping (compression -> seconds) in it")
    missing = [s for s in specs if s not in codecs]
    if missing:
        raise DDTrainError(f"--codec-times {path}: no time for {', '.join(missing)} (has {', '.join(codecs) or 'none'})")
    for spec, value in codecs.items():
        if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
            raise DDTrainError(f"--codec-times {path}: codec_s[{spec!r}] must be a number >= 0, got {value!r}")
    return {s: float(codecs[s]) for s in specs}


def read_calibration(path: str) -> dict:
    """alpha_s, beta_s_per_byte (and gamma_s_per_byte, burst_bytes when present) from a JSON file."""
    file = Path(path)
    if not file.is_file():
        raise DDTrainError(f"--calibration: no such file {path!r}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise DDTrainError(f"--calibration {path}: not JSON ({error.msg}, line {error.lineno})") from None
    for candidate in (data.get("loaded"), data.get("params"), (data.get("calibration") or {}).get("params"), data):
        if isinstance(candidate, dict) and "alpha_s" in candidate and "beta_s_per_byte" in candidate:
            values = {k: candidate[k] for k in ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte", "burst_bytes")
                      if candidate.get(k) is not None}
            by_algorithm = candidate.get("alpha_by_algorithm") or {}
            if not isinstance(by_algorithm, dict):
                raise DDTrainError(f"--calibration {path}: alpha_by_algorithm must map algorithm names to seconds")
            for k, v in [*values.items(), *((f"alpha_by_algorithm.{a}", x) for a, x in by_algorithm.items())]:
                if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                    raise DDTrainError(f"--calibration {path}: {k} must be a number >= 0, got {v!r}")
            return {**values, "alpha_by_algorithm": by_algorithm}
    raise DDTrainError(f"--calibration {path}: no alpha_s and beta_s_per_byte in it (at the top, or under "
                       f"'loaded', 'params' or 'calibration.params')")


def strategy_infos(names: str | None):
    """The adviser's view of ``ddtrain.sync.STRATEGIES`` (strategies it cannot predict are left out, said why)."""
    from ddtrain.costmodel.advise import StrategyInfo
    from ddtrain.sync import STRATEGIES
    from ddtrain.sync.local_sgd import ALGORITHM as LOCAL_SGD_ALGORITHM
    infos, skipped = {}, {}
    for name, spec in STRATEGIES.items():
        if spec.sync_in_backward and spec.algorithm and not spec.periodic:
            infos[name] = StrategyInfo(name=name, algorithm=spec.algorithm, kind="gradient",
                                       compressible=spec.takes_option("compression"))
        elif spec.periodic and not spec.sync_in_backward:
            outers = ("average", "nesterov") if spec.takes_option("outer_optimizer") else ("average",)
            infos[name] = StrategyInfo(name=name, algorithm=LOCAL_SGD_ALGORITHM, kind="average", outers=outers)
        else:
            skipped[name] = ("asynchronous: no step time to predict" if not spec.synchronous and not spec.periodic
                             else "parameter servers: not modelled" if spec.uses_servers
                             else "a ring every step plus a broadcast: never ahead of ring")
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        for n in wanted:
            if n not in STRATEGIES:
                raise DDTrainError(f"--strategies: unknown strategy {n!r}; known: {', '.join(STRATEGIES)}")
            if n not in infos:
                raise DDTrainError(f"--strategies: {n} cannot be predicted ({skipped[n]})")
        return [infos[n] for n in wanted], {}
    return list(infos.values()), skipped


def build_advice(args) -> dict:
    """Check every input, then predict and rank (the JSON-ready advice plus 'predictions')."""
    from ddtrain.cluster.netns import parse_rate
    from ddtrain.costmodel import advise
    from ddtrain.costmodel.burst import TokenBucket, emulated_burst_bytes, link_beta
    from ddtrain.costmodel.contention import cpu_slowdown
    if args.workers is None or args.workers < 1:
        raise DDTrainError(f"--workers must be >= 1, got {args.workers}")
    if args.batch_size < 1:
        raise DDTrainError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.procs_per_node < 1 or args.workers % args.procs_per_node:
        raise DDTrainError(f"--procs-per-node must be >= 1 and divide --workers ({args.workers}), "
                           f"got {args.procs_per_node}")
    if (args.step_time is None) == (not args.measure):
        raise DDTrainError("give exactly one of --step-time SECONDS or --measure")
    if (args.link_rate is None) == (args.calibration is None):
        raise DDTrainError("give exactly one of --link-rate RATE (with --latency) or --calibration FILE")
    if not (args.risk_bound >= 0 and math.isfinite(args.risk_bound)):
        raise DDTrainError(f"--risk-bound must be a number >= 0, got {args.risk_bound}")
    if (args.host_cores is None) != (args.ranks_per_host is None):
        raise DDTrainError("give --host-cores and --ranks-per-host together (or neither)")
    for flag, value in (("--host-cores", args.host_cores), ("--ranks-per-host", args.ranks_per_host)):
        if value is not None and value < 1:
            raise DDTrainError(f"{flag} must be >= 1, got {value}")
    strategies, skipped = strategy_infos(args.strategies)
    specs = [s.strip() for s in args.compressions.split(",") if s.strip()]
    if not specs:
        raise DDTrainError("--compressions: give at least one (e.g. none)")
    intervals = [parse_count(k, "--sync-every") for k in args.sync_every.split(",") if k.strip()]
    methods = advise.candidates(strategies, specs, intervals)
    shapes = model_shapes(args)
    compute_s = measure_step(args) if args.measure else parse_seconds(args.step_time, "--step-time")
    share = getattr(args, "backward_share", None)
    if share is not None and not 0 <= share <= 1:
        raise DDTrainError(f"--backward-share must be a number in [0, 1], got {share}")
    workload = advise.Workload(shapes=shapes, workers=args.workers, batch_size=args.batch_size, compute_s=compute_s,
                               procs_per_node=args.procs_per_node,
                               **({} if share is None else {"backward_share": share}))
    if args.calibration:
        cal = read_calibration(args.calibration)
        alpha, beta, gamma = cal["alpha_s"], cal["beta_s_per_byte"], cal.get("gamma_s_per_byte", 0.0)
        alpha_by_algorithm = cal["alpha_by_algorithm"]
        burst = cal.get("burst_bytes", 0)
        source = f"--calibration {args.calibration}"
    else:
        rate = parse_rate(args.link_rate)
        alpha, beta, gamma = parse_seconds(args.latency, "--latency"), link_beta(rate), 0.0
        source = f"--link-rate {args.link_rate} --latency {args.latency}"
        burst, alpha_by_algorithm = None, {}
    if args.burst == "emulated":
        if args.link_rate is None:
            raise DDTrainError("--burst emulated needs --link-rate (the tbf burst is 4 ms of the rate)")
        burst = emulated_burst_bytes(parse_rate(args.link_rate))
    elif args.burst != "0" or burst is None:   # an explicit --burst wins over the calibration file's
        burst = 0 if args.burst == "0" else parse_count(args.burst, "--burst")
    cpu_factor = 1.0
    if args.cpu_factor is not None:
        if not (args.cpu_factor > 0 and math.isfinite(args.cpu_factor)):
            raise DDTrainError(f"--cpu-factor must be a number > 0, got {args.cpu_factor}")
        cpu_factor = args.cpu_factor
    elif args.host_cores:   # the work was timed on one thread
        cpu_factor = cpu_slowdown(args.ranks_per_host, args.host_cores)
    if args.measure:   # measured alone here: the job's ranks share the host
        workload = dataclasses.replace(workload, compute_s=compute_s * cpu_factor)
    specs_used = sorted({m.compression for m in methods if m.compression != "none"})
    if args.codec_times:
        codecs = read_codec_times(args.codec_times, specs_used)
        cpu_factor = 1.0   # measured where the job runs, with its sharing
    else:
        codecs = measure_codecs(specs_used, shapes)
    network = advise.Network(alpha_s=alpha, bucket=TokenBucket(burst_bytes=burst, beta_s_per_byte=beta),
                             gamma_s_per_byte=gamma, codec_s=codecs, cpu_factor=cpu_factor,
                             alpha_by_algorithm=alpha_by_algorithm)
    advice = advise.advise(workload, network, methods, args.risk_bound)
    advice["inputs"] = {"model": args.model, "data": args.data if args.model else None,
                        "params": workload.params, "link": source,
                        "compute_s_source": ("measured here (--measure), times the cpu factor" if args.measure
                                             else "--step-time"),
                        "codec_s_source": (f"--codec-times {args.codec_times}" if args.codec_times
                                           else "timed here on one thread, times the cpu factor"),
                        "not_predicted": skipped}
    return advice


def render(advice: dict, top: int = 0) -> str:
    """Fixed-width table, units in the header, '#' before every non-data line."""
    w, n = advice["workload"], advice["network"]
    rows = advice["ranked"][:top] if top else advice["ranked"]
    first = advice["first_choice"]
    out = [f"# ddtrain advise: {w['params']:,} parameters ({w['gradient_bytes'] / 1e6:.1f} MB of float32 gradients), "
           f"{w['workers']} workers x batch {w['batch_size']}, compute step {1e3 * w['compute_s']:.1f} ms",
           f"# link: {advice['inputs']['link']}; alpha {1e3 * n['alpha_s']:.3f} ms per collective step"
           + "".join(f" ({a}: {1e3 * x:.3f} ms)" for a, x in n["alpha_by_algorithm"].items())
           + f", beta {1e9 * n['beta_s_per_byte']:.3f} ns/B, burst {n['burst_bytes']:,} B; codec measured alone here "
           f"x cpu factor {n['cpu_factor']:.2f}",
           "# step = compute + exposed: the collectives (alpha per step + bytes through the token bucket) and codec "
           "left after the backward pass (" + f"{100 * w.get('backward_share', 2 / 3):.0f}" + "% of the compute "
           "step) that DDP's buckets overlap; local SGD: compute + averaging / K; docs/ADVISE.md",
           f"# risk: accuracy points the choice may cost (exact / ours / published / unmeasured); "
           f"eligible = known within {advice['risk_bound_points']:g} point(s)",
           "#"]
    header = ("rank", "method", "step", "comm", "codec", "exposed", "bytes/step", "risk", "basis", "eligible")
    units = ("", "", "(ms)", "(ms)", "(ms)", "(ms)", "(MB)", "(points)", "", "")
    cells = []
    for i, r in enumerate(rows, 1):
        points = r["risk"]["points"]
        cells.append((str(i), r["label"], f"{1e3 * r['step_s']:.1f}", f"{1e3 * r['comm_s']:.1f}",
                      f"{1e3 * r['codec_s']:.1f}",
                      "-" if r.get("exposed_s") is None else f"{1e3 * r['exposed_s']:.1f}",
                      f"{r['bytes_per_step'] / 1e6:.3f}",
                      "?" if points is None else f"{points:g}", r["risk"]["basis"], "yes" if r["eligible"] else "no"))
    widths = [max(len(header[i]), len(units[i]), *(len(c[i]) for c in cells)) for i in range(len(header))]

    def line(values, lead):
        return lead + "  ".join(v.ljust(wd) if i == 1 else v.rjust(wd) for i, (v, wd) in enumerate(zip(values, widths)))
    out += [line(header, "# "), line(units, "# ")] + [line(c, "  ") for c in cells]
    out.append("#")
    if first:
        out.append(f"# first choice: {first['label']} -- predicted {1e3 * first['step_s']:.1f} ms per step, "
                   f"{first['bytes_per_step'] / 1e6:.3f} MB per step; run it with: ddtrain train "
                   + " ".join(first["train_args"]))
        out.append(f"#   its risk: {first['risk']['source']}")
    else:
        out.append(f"# no method is known to stay within {advice['risk_bound_points']:g} accuracy point(s)")
    for name, why in advice["inputs"]["not_predicted"].items():
        out.append(f"# not predicted: {name} ({why})")
    return "\n".join(out)


def main(args) -> int:
    advice = build_advice(args)
    advice.pop("predictions")
    if args.json == "-":
        print(json.dumps(advice, indent=2))
        return 0
    print(render(advice, args.top))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(advice, indent=2) + "\n")
    return 0
