"""What ``ddtrain advise`` is asked, and the readers of its numbers: no torch here, so that ``ddtrain advise --help``
answers at once (issue 32: 1.7-7 s with torch imported for two defaults).

``AdviceRequest``'s fields are the command's flags; ``ddtrain.bench.advise.build_advice`` checks
them together, measures what is asked and predicts.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ddtrain.errors import DDTrainError

DEFAULT_COMPRESSIONS = "none,fp16,bf16,powersgd:4,topk:0.1"   # topk:0.1 is the fraction our runs measured
DEFAULT_INTERVALS = "4,20"
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
# bounds of what the adviser predicts: the prediction is arithmetic, but a count past any model (1e14 parameters:
# 400 TB of float32 gradients) or a link slower than 1 kbit/s is a typo, not a question (issue 32: --params 1e12
# allocated 4 TB to time the codecs; a near-zero bandwidth predicted inf ms and still named a first choice)
MAX_PARAMS = 10 ** 14
MAX_LATENCY_S = 60.0
MAX_STEP_S = 86_400.0
MAX_BETA_S_PER_BYTE = 8e-3     # 1 kbit/s


@dataclass(kw_only=True)
class AdviceRequest:
    """What ``ddtrain advise`` is asked: each field is the flag of the same name (``ddtrain advise --help``)."""

    model: str | None = None              # a model of the zoo (its parameter shapes), or ...
    params: str | int | None = None       # ... a parameter count (one square matrix assumed for PowerSGD)
    data: str = "cifar10"                 # input shape and classes of the model (ddtrain.data.synthetic.SHAPES)
    workers: int | None = None            # training ranks
    batch_size: int = 32                  # samples per step on each worker
    procs_per_node: int = 1               # ranks sharing one node (its link)
    step_time: str | float | None = None  # the measured compute step, e.g. 0.4 or "400ms"; or ...
    measure: bool = False                 # ... time a few steps of the model here (one thread)
    backward_share: float | None = None   # the part of the compute step that is the backward pass (default 2/3)
    host_cores: int | None = None         # cores the ranks of one host share (with ranks_per_host)
    ranks_per_host: int | None = None
    cpu_factor: float | None = None       # how much slower work timed here runs in the job (overrides the two above)
    link_rate: str | None = None          # each node's link rate in tc's bit units, or ...
    latency: str = "0.2ms"                # (α per collective step, with link_rate)
    burst: str = "0"                      # token-bucket burst in bytes, or "emulated"
    codec_times: str | None = None        # JSON file of the compressors' work measured where the job runs
    calibration: str | None = None        # ... a JSON file with alpha_s and beta_s_per_byte instead of link_rate
    strategies: str | None = None         # comma-separated; default: every one the model predicts
    compressions: str = DEFAULT_COMPRESSIONS
    sync_every: str = DEFAULT_INTERVALS   # intervals to compare for averaging strategies
    risk_bound: float = 1.0               # accuracy points the first choice may cost


def parse_seconds(text: str, flag: str, most: float = math.inf) -> float:
    """``"2ms"`` -> 0.002, ``"0.4"`` -> 0.4; a clear error otherwise (also above ``most`` seconds)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(s|ms|us|µs)?\s*", str(text))
    if not match:
        raise DDTrainError(f"{flag}: cannot read {text!r} as a time; write e.g. 0.4, 400ms or 200us")
    value = float(match.group(1)) * _TIME_UNITS[match.group(2) or "s"]
    if not math.isfinite(value):
        raise DDTrainError(f"{flag}: {text!r} is not a finite time")
    if value > most:
        raise DDTrainError(f"{flag}: {text!r} is more than {most:g} s; no link or step the adviser predicts is that slow")
    return value


def parse_count(text: str, flag: str, most: int | None = None) -> int:
    """A whole number >= 1 (``25_600_000``, or ``1e9`` when that is whole), at most ``most``."""
    raw = str(text).replace("_", "").strip()
    try:
        value = int(raw) if raw.isdecimal() else float(raw)
    except ValueError:
        raise DDTrainError(f"{flag}: {text!r} is not a whole number") from None
    if isinstance(value, float):
        if not (math.isfinite(value) and value == int(value)):
            raise DDTrainError(f"{flag}: {text!r} is not a whole number")
        value = int(value)
    if value < 1:
        raise DDTrainError(f"{flag}: must be >= 1, got {value}")
    if most is not None and value > most:
        raise DDTrainError(f"{flag}: must be at most {most:.0e}, got {text!r}")
    return value


