"""Predict the step time and bytes of every strategy × compression × algorithm, rank them, and pick one.

A step of a method that syncs gradients every step is predicted as

    step = compute + exposed (what is left after the backward pass of, bucket by bucket: the codec, the compressor's
           own work scaled by the ranks sharing the host's cores, and Σ over the bucket's collectives
           (α_load · steps + link time through the token bucket + γ · added bytes))

with the collectives read from the compression method (``ddtrain.comm.compression``): one
all-reduce of each DDP bucket (1 MiB first, then ``bucket_cap``), a 16-bit one for fp16/bf16,
three per bucket for PowerSGD after its warm-up (the uncompressed tensors, P, Q), one ring
all-gather of (value, index) pairs for top-k. The compressor's own work (casts, PowerSGD's products and
orthogonalisation, top-k's selection) is measured alone on the real shapes (``Network.codec_s``) and multiplied by the host's
CPU sharing (``Network.cpu_factor``: ``contention.cpu_slowdown``, or a measured ratio). Each
bucket's codec and collectives overlap the rest of the backward pass (``overlap``): the step pays
``compute + exposed`` instead of ``compute + comm + codec``. A method that averages parameters
every K steps (local SGD) pays one all-reduce of the parameters every K steps after its step (no
overlap): ``step = compute + averaging / K``. ``Network.plain`` gives the old model (calibrated
α, no bucket, compute as given, no overlap) for comparison.

The ranking is by predicted step time; the first choice is the fastest whose accuracy risk
(``risks``) is known to be within ``risk_bound_points``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ddtrain.comm import compression as compressions
from ddtrain.comm.compression import powersgd, topk
from ddtrain.comm.compression.volume import allgather_bytes, allreduce_bytes, numel
from ddtrain.costmodel import schedule
from ddtrain.costmodel.burst import TokenBucket, transfer
from ddtrain.costmodel.overlap import BACKWARD_SHARE_OF_FORWARD_BACKWARD, exposed_s
from ddtrain.costmodel.risks import Risk, risk_of
from ddtrain.errors import DDTrainError

FIRST_BUCKET_BYTES = 1 << 20          # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
DEFAULT_BUCKET_CAP_BYTES = 25 << 20   # DDP's bucket_cap_mb=25
RISK_BOUND_POINTS = 1.0
ALLGATHER_ALGORITHM = "ring"          # comm.allgather (top-k's collective) is a ring: R-1 steps of every rank's part


@dataclass(frozen=True, kw_only=True)
class Method:
    """One choice: a strategy, the algorithm it reduces with, a gradient compression, a sync interval."""

    strategy: str
    algorithm: str
    kind: str                   # "gradient" (every step), "average" (parameters every sync_every steps)
    compression: str = "none"
    sync_every: int = 1
    outer: str = "average"      # averaging strategies: "average" (the replicas' mean) or "nesterov" (DiLoCo's outer step)
    extra_ranks: int = 0        # ranks besides the workers that take part (parameter servers)
    sharded: tuple[str, ...] = ()   # kind "sharded": its collectives over the whole model ("allreduce", "allgather")
    shards: tuple[str, ...] = ()    # kind "sharded": what it splits ("parameters", "gradients", "optimizer_state")

    @property
    def label(self) -> str:
        if self.kind == "average":
            return f"{self.strategy} {self.outer} K={self.sync_every}"
        return f"{self.strategy} {self.compression}" + ("" if self.algorithm == self.strategy else f" ({self.algorithm})")

    def train_args(self) -> list[str]:
        """The ``ddtrain train`` flags that run this method."""
        args = ["--strategy", self.strategy]
        if self.compression != "none":
            args += ["--compression", self.compression]
        if self.kind == "average":
            args += ["--sync-every", str(self.sync_every)]
            if self.outer != "average":
                args += ["--outer-optimizer", self.outer]
        return args


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What trains: the gradient shapes, the workers, the batch per worker, the measured compute step."""

    shapes: tuple[tuple[int, ...], ...]
    workers: int
    batch_size: int
    compute_s: float                      # forward+backward+optimizer of one step, no communication (as measured)
    procs_per_node: int = 1
    bucket_cap_bytes: float = DEFAULT_BUCKET_CAP_BYTES
    # the part of compute_s that is the backward pass (what bucket communication can hide behind): the FLOP
    # rule's 2/3 of forward+backward by default, data and optimizer counted in (unknown from one step time)
    backward_share: float = BACKWARD_SHARE_OF_FORWARD_BACKWARD

    def __post_init__(self):
        if not self.shapes:
            raise DDTrainError("the model has no parameters to synchronise")
        if self.workers < 1:
            raise DDTrainError(f"workers must be >= 1, got {self.workers}")
        if self.batch_size < 1:
            raise DDTrainError(f"batch size must be >= 1, got {self.batch_size}")
        if not (self.compute_s >= 0 and math.isfinite(self.compute_s)):
            raise DDTrainError(f"the compute step time must be a finite number >= 0 s, got {self.compute_s}")
        if not 0 <= self.backward_share <= 1:
            raise DDTrainError(f"the backward share of the compute step must be in [0, 1], got {self.backward_share}")
        if self.procs_per_node < 1 or self.workers % self.procs_per_node:
            raise DDTrainError(f"procs per node must be >= 1 and divide the workers ({self.workers}), "
                               f"got {self.procs_per_node}")

    @property
    def params(self) -> int:
        return sum(numel(s) for s in self.shapes)


@dataclass(frozen=True, kw_only=True)
class Network:
    """The link and the host: α (under load, or calibrated), the token bucket, γ, the compressors' own work."""

    alpha_s: float
    bucket: TokenBucket                   # burst 0 for a link without one
    gamma_s_per_byte: float = 0.0         # local add per byte (the reduction)
    codec_s: Mapping[str, float] = field(default_factory=dict)  # compression spec -> seconds per step, measured alone
    # α of algorithms whose steps cost differently: Gloo's own all-reduce ("native") runs its steps in C++,
    # ours are Python point-to-point calls on the communication thread (alpha_s)
    alpha_by_algorithm: Mapping[str, float] = field(default_factory=dict)
    cpu_factor: float = 1.0               # how much slower the ranks' own work runs on the shared host (contention)
    overlap: bool = True                  # bucket communication overlaps the backward pass (DDP hooks; costmodel.overlap)
    name: str = "new"

    def alpha_for(self, algorithm: str) -> float:
        return self.alpha_by_algorithm.get(algorithm, self.alpha_s)

    def plain(self, alpha_s: float) -> Network:
        """The old model over the same link: α as calibrated, no token bucket, no CPU sharing, no overlap."""
        return Network(alpha_s=alpha_s, bucket=TokenBucket(burst_bytes=0, beta_s_per_byte=self.bucket.beta_s_per_byte),
                       gamma_s_per_byte=self.gamma_s_per_byte, codec_s=self.codec_s, cpu_factor=1.0, overlap=False,
                       name="old")


@dataclass(kw_only=True)
class Prediction:
    """One method's predicted step, its bytes and its accuracy risk."""

    method: Method
    step_s: float
    comm_s: float
    codec_s: float
    bytes_per_step: float                 # bytes one worker sends per step, mean over the workers
    collectives_per_step: float
    risk: Risk
    eligible: bool = False                # accuracy risk within the bound
    exposed_s: float | None = None        # communication + codec the step waits for (less than both: overlap)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        m = self.method
        return {"label": m.label, "strategy": m.strategy, "algorithm": m.algorithm, "compression": m.compression,
                "sync_every": m.sync_every, "outer": m.outer, "kind": m.kind, "train_args": m.train_args(),
                "step_s": self.step_s, "comm_s": self.comm_s, "codec_s": self.codec_s, "exposed_s": self.exposed_s,
                "bytes_per_step": self.bytes_per_step, "collectives_per_step": self.collectives_per_step,
                "risk": self.risk.as_dict(), "eligible": self.eligible, "notes": self.notes}


@dataclass(frozen=True, kw_only=True)
class StrategyInfo:
    """What the adviser needs of a strategy (``ddtrain.bench.advise.strategy_infos`` reads them from
    ``ddtrain.sync.STRATEGIES``: its ``sends``, ``algorithm`` and ``averaging_algorithm``)."""

    name: str
    algorithm: str              # the ddtrain.comm algorithm that carries what it sends
    kind: str                   # gradient | average
    extra_ranks: int = 0
    compressible: bool = True   # takes --compression
    sharded: tuple[str, ...] = ()   # kind "sharded" (zero1, zero2, fsdp): its collectives over the whole model
    shards: tuple[str, ...] = ()    # kind "sharded": what it splits over the ranks
    outers: tuple[str, ...] = ("average",)   # averaging strategies: the outer steps it offers


def predictable(strategies: Sequence[StrategyInfo]) -> tuple[list[StrategyInfo], dict[str, str]]:
    """The strategies whose algorithm's record holds all the adviser needs, and why each other one is left out."""
    kept, skipped = [], {}
    for s in strategies:
        gaps = schedule.missing(s.algorithm)
        if gaps:
            skipped[s.name] = f"its algorithm {s.algorithm}: {', '.join(gaps)}"
        else:
            kept.append(s)
    return kept, skipped


def candidates(strategies: Sequence[StrategyInfo], compression_specs: Sequence[str],
               intervals: Sequence[int]) -> list[Method]:
    """Every strategy × compression (gradient strategies) and strategy × interval (averaging strategies)."""
    for spec in compression_specs:
        try:
            compressions.check_spec(spec)
        except ValueError as error:
            raise DDTrainError(str(error)) from None
    for k in intervals:
        if not isinstance(k, int) or k < 1:
            raise DDTrainError(f"a sync interval must be a whole number >= 1, got {k!r}")
    out, gathered = [], set()
    for s in strategies:
        if s.kind == "gradient":
            specs = compression_specs if s.compressible else [c for c in compression_specs if c == "none"]
            for c in specs:
                # an all-gathered method (top-k) sends the same messages whatever the strategy's
                # algorithm: listed once, with the first strategy that takes it
                if compressions.parse_spec(c)[0].collective == "all-gather":
                    if c in gathered:
                        continue
                    gathered.add(c)
                out.append(Method(strategy=s.name, algorithm=s.algorithm, kind="gradient", compression=c,
                                  extra_ranks=s.extra_ranks))
        elif s.kind == "sharded":
            out.append(Method(strategy=s.name, algorithm=s.algorithm, kind="sharded", sharded=s.sharded,
                              shards=s.shards))
        elif s.kind == "average":
            out += [Method(strategy=s.name, algorithm=s.algorithm, kind="average", sync_every=k, outer=o)
                    for o in s.outers for k in intervals]
        else:
            raise DDTrainError(f"strategy {s.name!r}: unknown kind {s.kind!r} (gradient, sharded or average)")
    return out


def buckets(shapes: Sequence[tuple[int, ...]], cap_bytes: float, element_size: int = 4) -> list[list[tuple[int, ...]]]:
    """DDP's buckets: parameters in reverse order (gradients become ready last layer first), 1 MiB first, then ``cap``."""
    out, current, size, cap = [], [], 0, min(FIRST_BUCKET_BYTES, cap_bytes)
    for shape in reversed(list(shapes)):
        current.append(tuple(shape))
        size += numel(shape) * element_size
        if size >= cap:
            out.append(current)
            current, size, cap = [], 0, cap_bytes
    if current:
        out.append(current)
    return out


def collectives(method: Method, workload: Workload) -> list[tuple[str, float]]:
    """The (kind, bytes per rank) of each collective one step of ``method`` runs, in order ('allreduce' or 'allgather')."""
    return [c for _, bucket in bucket_collectives(method, workload) for c in bucket]


def bucket_collectives(method: Method, workload: Workload) -> list[tuple[int, list[tuple[str, float]]]]:
    """(elements, its collectives) of each DDP bucket in the order backward fills them (averaging: one, the parameters)."""
    if method.kind == "average":
        return [(workload.params, [("allreduce", workload.params * 4.0)])]
    if method.kind == "sharded":   # one flat buffer after backward; an all-gather's bytes are each rank's shard
        whole = workload.params * 4.0
        return [(workload.params, [(kind, whole if kind == "allreduce" else whole / workload.workers)
                                   for kind in method.sharded])]
    record, argument = compressions.parse_spec(method.compression)
    out = []
    for bucket in buckets(workload.shapes, workload.bucket_cap_bytes):
        elements = sum(numel(s) for s in bucket)
        if record.name == "none":
            these = [("allreduce", elements * 4.0)]
        elif record.name in ("fp16", "bf16"):
            these = [("allreduce", elements * 2.0)]
        elif record.name == "powersgd":
            plans = [powersgd.matrix_plan(s, argument[0]) for s in bucket]
            plain = sum(numel(s) for s, plan in zip(bucket, plans) if not plan[0])
            p = sum(n * r for compressed, n, m, r in plans if compressed)
            q = sum(m * r for compressed, n, m, r in plans if compressed)
            these = [("allreduce", x * 4.0) for x in (plain, p, q) if x]
        elif record.name == "topk":
            k = sum(topk.kept(numel(s), argument) for s in bucket)
            these = [("allgather", k * (4.0 + topk.INDEX_BYTES))]
        else:
            raise DDTrainError(f"no cost model for compression {method.compression!r}")
        out.append((elements, these))
    return out


def memory_per_rank(method: Method, workload: Workload, state_per_parameter: int = 1) -> dict:
    """Bytes one rank holds: fp32 parameters, gradients and optimizer state (``state_per_parameter`` tensors of the
    parameters' size: SGD with momentum 1, Adam 2), each split over the workers where the method shards it.

    ZeRO keeps a copy of its shard of the parameters besides the whole model (1 + 1/R of ddp's; measured by
    ddtrain.sync.memory, docs/SHARDING.md).
    """
    whole, r = workload.params * 4.0, workload.workers
    split = set(method.shards) if method.kind == "sharded" else set()
    parameters = whole / r if "parameters" in split else whole * (1 + 1 / r) if split else whole
    return {"parameter_bytes": parameters, "gradient_bytes": whole / r if "gradients" in split else whole,
            "optimizer_state_bytes": state_per_parameter * whole / (r if "optimizer_state" in split else 1)}


def codec_seconds(method: Method, workload: Workload, network: Network) -> float:
    """The compressor's own work per step on one rank: measured alone (``Network.codec_s``), times the host's sharing."""
    if method.kind != "gradient" or method.compression == "none":
        return 0.0
    if method.compression not in network.codec_s:
        raise DDTrainError(f"no measured codec time for compression {method.compression!r} "
                           f"(measured: {', '.join(network.codec_s) or 'none'})")
    return network.codec_s[method.compression] * network.cpu_factor


def collective_seconds(kind: str, nbytes: float, ranks: int, algorithm: str, network: Network,
                       procs_per_node: int, tokens: float) -> tuple[float, float, int]:
    """(seconds, tokens left, steps) of one collective, starting with ``tokens`` in the link's bucket."""
    if ranks == 1 or nbytes == 0:
        return 0.0, tokens, 0
    if kind == "allgather":   # comm.allgather: the ring, R-1 steps of every rank's whole part, nothing added
        algorithm = ALLGATHER_ALGORITHM
        messages, added = [nbytes] * (ranks - 1), 0.0
    else:
        messages, added = schedule.steps(algorithm, nbytes, ranks), schedule.added_bytes(algorithm, nbytes, ranks)
    share = schedule.link_share(algorithm, ranks, procs_per_node)
    bucket = TokenBucket(burst_bytes=network.bucket.burst_bytes, beta_s_per_byte=network.bucket.beta_s_per_byte * share)
    alpha = network.alpha_for(algorithm)
    link, left = transfer(messages, bucket, gap_s=alpha, start_tokens=tokens)
    return alpha * len(messages) + link + network.gamma_s_per_byte * added, left, len(messages)


def predict(method: Method, workload: Workload, network: Network) -> Prediction:
    """Predicted step of ``method`` (see the module docstring)."""
    ranks = workload.workers + method.extra_ranks
    per_bucket = bucket_collectives(method, workload)
    per_step = [c for _, bucket in per_bucket for c in bucket]
    # the compute step before the first collective refills the bucket (the gaps between buckets while backward
    # fills the next are not credited: the burst is at most 4 ms of the rate, small against a 25 MB bucket)
    tokens = network.bucket.refill(0.0, workload.compute_s)
    bucket_comm = []
    for _, bucket in per_bucket:
        seconds_here = 0.0
        for kind, nbytes in bucket:
            seconds, tokens, _ = collective_seconds(kind, nbytes, ranks, method.algorithm, network,
                                                    workload.procs_per_node, tokens)
            seconds_here += seconds
        bucket_comm.append(seconds_here)
    comm_s = sum(bucket_comm)
    sent = sum(allgather_bytes(b, ranks) if kind == "allgather" else allreduce_bytes(b, ranks) for kind, b in per_step)
    codec = codec_seconds(method, workload, network)
    every = method.sync_every if method.kind == "average" else 1
    if method.kind == "gradient" and network.overlap:
        # every gradient strategy is a DDP hook: a bucket's codec and collectives start once backward has filled it
        # and run on one communication thread; the codec is shared among buckets by their elements (its work, casts
        # and products, is per element)
        elements = [e for e, _ in per_bucket]
        work = [c + codec * e / sum(elements) for c, (e, _) in zip(bucket_comm, per_bucket)]
        exposed = exposed_s(workload.backward_share * workload.compute_s, elements, work)
    else:
        # local SGD averages after its step, nothing to hide behind: sequential. The sharded strategies too: ZeRO
        # reduces one flat buffer after backward; FSDP overlaps its all-gathers with compute (prefetch), which this
        # leaves out (an upper bound on its step)
        exposed = (comm_s + codec) / every
    risk = (risk_of(local_sgd_interval=method.sync_every, outer=method.outer) if method.kind == "average"
            else risk_of(method.compression))
    notes = []
    if method.kind == "sharded":
        memory = memory_per_rank(method, workload)
        notes.append("memory per rank (SGD+momentum; Adam: twice the state): "
                     + ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {v / 1e6:.1f} MB" for k, v in memory.items()))
    return Prediction(method=method, step_s=workload.compute_s + exposed, comm_s=comm_s / every,
                      codec_s=codec / every, bytes_per_step=sent / every, collectives_per_step=len(per_step) / every,
                      risk=risk, exposed_s=exposed, notes=notes)


def rank(predictions: Sequence[Prediction], risk_bound_points: float = RISK_BOUND_POINTS) -> list[Prediction]:
    """Fastest predicted first (ties: fewer bytes); marks those whose risk is known within the bound."""
    for p in predictions:
        p.eligible = p.risk.within(risk_bound_points)
    return sorted(predictions, key=lambda p: (p.step_s, p.bytes_per_step, p.method.label))


def first_choice(ranked: Sequence[Prediction]) -> Prediction | None:
    """The fastest eligible prediction of a ``rank``-ed list (None when none is eligible)."""
    return next((p for p in ranked if p.eligible), None)


def top_distinct(ranked: Sequence[Prediction], n: int = 3) -> list[Prediction]:
    """The ``n`` fastest eligible methods with distinct (strategy, compression, interval), each with its best algorithm."""
    seen, out = set(), []
    for p in ranked:
        m = p.method
        key = (m.kind, m.compression, m.sync_every, m.outer, "ddp-family" if m.kind == "gradient" else m.strategy)
        if p.eligible and key not in seen:
            seen.add(key)
            out.append(p)
        if len(out) == n:
            break
    return out


def advise(workload: Workload, network: Network, methods: Sequence[Method],
           risk_bound_points: float = RISK_BOUND_POINTS) -> dict:
    """Predict and rank ``methods``; a JSON-ready summary with the first choice and the top 3 distinct."""
    if not methods:
        raise DDTrainError("no methods to compare")
    predictions = [predict(m, workload, network) for m in methods]
    # a link so slow (or a latency so long) that a step overflows to infinity is no prediction: ranking it would
    # name a first choice "predicted inf ms per step" (issue 32); it is left out, and with every one left out the
    # adviser says so instead of choosing
    predictable_ = [all(math.isfinite(x) for x in (p.step_s, p.comm_s, p.bytes_per_step)) for p in predictions]
    finite = [p for p, ok in zip(predictions, predictable_) if ok]
    if not finite:
        raise DDTrainError(f"no method is predictable on this link: every predicted step time is infinite "
                           f"(alpha {network.alpha_s:g} s, beta {network.bucket.beta_s_per_byte:g} s per byte); "
                           f"check the link rate, latency or calibration")
    ranked = rank(finite, risk_bound_points)
    first = first_choice(ranked)
    return {"workload": {"params": workload.params, "gradient_bytes": workload.params * 4, "workers": workload.workers,
                         "batch_size": workload.batch_size, "compute_s": workload.compute_s,
                         "backward_share": workload.backward_share,
                         "procs_per_node": workload.procs_per_node},
            "network": {"name": network.name, "alpha_s": network.alpha_s,
                        "alpha_by_algorithm": dict(network.alpha_by_algorithm), "burst_bytes": network.bucket.burst_bytes,
                        "beta_s_per_byte": network.bucket.beta_s_per_byte,
                        "rate_Mbit_s": 8e-6 / network.bucket.beta_s_per_byte if network.bucket.beta_s_per_byte else None,
                        "gamma_s_per_byte": network.gamma_s_per_byte, "codec_s": dict(network.codec_s),
                        "cpu_factor": network.cpu_factor, "overlap": network.overlap},
            "risk_bound_points": risk_bound_points,
            "first_choice": first.as_dict() if first else None,
            "top3": [p.as_dict() for p in top_distinct(ranked, 3)],
            "ranked": [p.as_dict() for p in ranked],
            "not_predictable": [p.method.label for p, ok in zip(predictions, predictable_) if not ok],
            "predictions": ranked}
