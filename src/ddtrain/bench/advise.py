"""The adviser as a library: its inputs checked, its measurements, its strategies, its table.

    from ddtrain.bench.advise import AdviceRequest, build_advice, render
    advice = build_advice(AdviceRequest(model="resnet18", workers=4, step_time="0.4", link_rate="100mbit"))
    print(render(advice))

``ddtrain advise`` is this module behind its flags (``AdviceRequest``'s fields are the flags, and
its errors name them). The prediction and the ranking are ``ddtrain.costmodel.advise`` (pure, no
processes); here are what feeds them: the strategies, read from ``ddtrain.sync.STRATEGIES``
(``StrategySpec.sends`` and its algorithm, skipping with the reason those it cannot predict and
those whose ``ddtrain.comm`` algorithm lacks a cost term); the model's gradient shapes; the compute
step and the compressors' work timed here (``bench.measure``) or read from files; the link.
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path

from ddtrain.bench.advice_request import (MAX_BETA_S_PER_BYTE, MAX_LATENCY_S, MAX_PARAMS, MAX_STEP_S, AdviceRequest,
                                          parse_count, parse_seconds)
from ddtrain.bench.measure import CODEC_SAMPLE_ELEMENTS, measure_codecs, measure_step, zoo_model
from ddtrain.cluster.netns import parse_rate
from ddtrain.costmodel import advise
from ddtrain.costmodel.burst import TokenBucket, emulated_burst_bytes, link_beta
from ddtrain.costmodel.contention import cpu_slowdown
from ddtrain.errors import DDTrainError
from ddtrain.sync import STRATEGIES
from ddtrain.sync.base import SyncOptions

# the outer steps an averaging strategy that reads --outer-optimizer offers (SyncOptions.outer_optimizer's choices)
OUTER_STEPS = typing.get_args(typing.get_type_hints(SyncOptions)["outer_optimizer"])


def model_shapes(model: str | None = None, params: str | int | None = None,
                 data: str = "cifar10") -> tuple[tuple[int, ...], ...]:
    """Gradient shapes of zoo ``model`` (built on the meta device: no memory, no time), or one square matrix of
    ``params`` parameters."""
    if (model is None) == (params is None):
        raise DDTrainError("give exactly one of --model NAME or --params N")
    if params is not None:
        n = parse_count(params, "--params", most=MAX_PARAMS)
        side = math.isqrt(n)
        return ((side, side), (n - side * side,)) if n > side * side else ((side, side),)
    return tuple(tuple(p.shape) for p in zoo_model(model, data).parameters() if p.requires_grad)


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
                if k.startswith("alpha") and v > MAX_LATENCY_S:
                    raise DDTrainError(f"--calibration {path}: {k} {v:g} s is more than {MAX_LATENCY_S:g} s per "
                                       f"collective step; not a link the adviser predicts")
            if values["beta_s_per_byte"] > MAX_BETA_S_PER_BYTE:
                raise DDTrainError(f"--calibration {path}: beta_s_per_byte {values['beta_s_per_byte']:g} is a link "
                                   f"of {8 / values['beta_s_per_byte']:.3g} bit/s, below 1 kbit/s; not a link the "
                                   f"adviser predicts")
            return {**values, "alpha_by_algorithm": by_algorithm}
    raise DDTrainError(f"--calibration {path}: no alpha_s and beta_s_per_byte in it (at the top, or under "
                       f"'loaded', 'params' or 'calibration.params')")


def strategy_infos(names: str | None = None) -> tuple[list[advise.StrategyInfo], dict[str, str]]:
    """The adviser's view of ``ddtrain.sync.STRATEGIES`` (``names``: comma-separated, default all) and, by name,
    why each strategy it cannot predict is left out: its spec's ``not_predicted``, or what its algorithm lacks."""
    infos, skipped = [], {}
    for name, spec in STRATEGIES.items():
        info = spec.advice_info(OUTER_STEPS)
        if info is None:
            skipped[name] = spec.not_predicted or "its StrategySpec does not say what it sends (sends=)"
        else:
            infos.append(info)
    infos, unmodelled = advise.predictable(infos)
    skipped = {n: skipped.get(n) or unmodelled[n] for n in STRATEGIES if n in skipped or n in unmodelled}
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        for n in wanted:
            if n not in STRATEGIES:
                raise DDTrainError(f"--strategies: unknown strategy {n!r}; known: {', '.join(STRATEGIES)}")
            if n in skipped:
                raise DDTrainError(f"--strategies: {n} cannot be predicted ({skipped[n]})")
        by_name = {s.name: s for s in infos}
        return [by_name[n] for n in wanted], {}
    return infos, skipped


def build_advice(request: AdviceRequest) -> dict:
    """Check every input, then predict and rank (the JSON-ready advice plus 'predictions', the Prediction objects)."""
    r = request
    if r.workers is None or r.workers < 1:
        raise DDTrainError(f"--workers must be >= 1, got {r.workers}")
    if r.batch_size < 1:
        raise DDTrainError(f"--batch-size must be >= 1, got {r.batch_size}")
    if r.procs_per_node < 1 or r.workers % r.procs_per_node:
        raise DDTrainError(f"--procs-per-node must be >= 1 and divide --workers ({r.workers}), "
                           f"got {r.procs_per_node}")
    if (r.step_time is None) == (not r.measure):
        raise DDTrainError("give exactly one of --step-time SECONDS or --measure")
    if (r.link_rate is None) == (r.calibration is None):
        raise DDTrainError("give exactly one of --link-rate RATE (with --latency) or --calibration FILE")
    if not (r.risk_bound >= 0 and math.isfinite(r.risk_bound)):
        raise DDTrainError(f"--risk-bound must be a number >= 0, got {r.risk_bound}")
    if (r.host_cores is None) != (r.ranks_per_host is None):
        raise DDTrainError("give --host-cores and --ranks-per-host together (or neither)")
    for flag, value in (("--host-cores", r.host_cores), ("--ranks-per-host", r.ranks_per_host)):
        if value is not None and value < 1:
            raise DDTrainError(f"{flag} must be >= 1, got {value}")
    strategies, skipped = strategy_infos(r.strategies)
    specs = [s.strip() for s in r.compressions.split(",") if s.strip()]
    if not specs:
        raise DDTrainError("--compressions: give at least one (e.g. none)")
    intervals = [parse_count(k, "--sync-every") for k in r.sync_every.split(",") if k.strip()]
    methods = advise.candidates(strategies, specs, intervals)
    shapes = model_shapes(r.model, r.params, r.data)
    compute_s = (measure_step(r.model, r.data, r.batch_size) if r.measure
                 else parse_seconds(r.step_time, "--step-time", most=MAX_STEP_S))
    share = r.backward_share
    if share is not None and not 0 <= share <= 1:
        raise DDTrainError(f"--backward-share must be a number in [0, 1], got {share}")
    workload = advise.Workload(shapes=shapes, workers=r.workers, batch_size=r.batch_size, compute_s=compute_s,
                               procs_per_node=r.procs_per_node,
                               **({} if share is None else {"backward_share": share}))
    if r.calibration:
        cal = read_calibration(r.calibration)
        alpha, beta, gamma = cal["alpha_s"], cal["beta_s_per_byte"], cal.get("gamma_s_per_byte", 0.0)
        alpha_by_algorithm = cal["alpha_by_algorithm"]
        burst = cal.get("burst_bytes", 0)
        source = f"--calibration {r.calibration}"
    else:
        rate = parse_rate(r.link_rate)
        alpha, beta, gamma = parse_seconds(r.latency, "--latency", most=MAX_LATENCY_S), link_beta(rate), 0.0
        source = f"--link-rate {r.link_rate} --latency {r.latency}"
        burst, alpha_by_algorithm = None, {}
    if r.burst == "emulated":
        if r.link_rate is None:
            raise DDTrainError("--burst emulated needs --link-rate (the tbf burst is 4 ms of the rate)")
        burst = emulated_burst_bytes(parse_rate(r.link_rate))
    elif r.burst != "0" or burst is None:   # an explicit --burst wins over the calibration file's
        burst = 0 if r.burst == "0" else parse_count(r.burst, "--burst")
    cpu_factor = 1.0
    if r.cpu_factor is not None:
        if not (r.cpu_factor > 0 and math.isfinite(r.cpu_factor)):
            raise DDTrainError(f"--cpu-factor must be a number > 0, got {r.cpu_factor}")
        cpu_factor = r.cpu_factor
    elif r.host_cores:   # the work was timed on one thread
        cpu_factor = cpu_slowdown(r.ranks_per_host, r.host_cores)
    if r.measure:   # measured alone here: the job's ranks share the host
        workload = dataclasses.replace(workload, compute_s=compute_s * cpu_factor)
    specs_used = sorted({m.compression for m in methods if m.compression != "none"})
    if r.codec_times:
        codecs = read_codec_times(r.codec_times, specs_used)
        cpu_factor = 1.0   # measured where the job runs, with its sharing
    else:
        codecs = measure_codecs(specs_used, shapes)
    network = advise.Network(alpha_s=alpha, bucket=TokenBucket(burst_bytes=burst, beta_s_per_byte=beta),
                             gamma_s_per_byte=gamma, codec_s=codecs, cpu_factor=cpu_factor,
                             alpha_by_algorithm=alpha_by_algorithm)
    advice = advise.advise(workload, network, methods, r.risk_bound)
    advice["inputs"] = {"model": r.model, "data": r.data if r.model else None,
                        "params": workload.params, "link": source,
                        "compute_s_source": ("measured here (--measure), times the cpu factor" if r.measure
                                             else "--step-time"),
                        "codec_s_source": (f"--codec-times {r.codec_times}" if r.codec_times
                                           else "timed here on one thread, times the cpu factor"
                                           + ("" if workload.params <= CODEC_SAMPLE_ELEMENTS else
                                              f" (on a sample of {CODEC_SAMPLE_ELEMENTS:,} elements, scaled by "
                                              f"the gradient's)")),
                        "not_predicted": skipped}
    return advice


def render(advice: dict, top: int | None = None) -> str:
    """Fixed-width table, units in the header, '#' before every non-data line; the ``top`` first rows (None: all)."""
    if top is not None and top < 1:   # [:-1] dropped the last row without a word (issue 32)
        raise DDTrainError(f"--top must be at least 1 (leave it out for every row), got {top}")
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
    for label in advice.get("not_predictable", []):
        out.append(f"# not predictable: {label} (its predicted step time is infinite on this link)")
    for name, why in advice["inputs"]["not_predicted"].items():
        out.append(f"# not predicted: {name} ({why})")
    return "\n".join(out)
