"""What the rest of ddtrain knows about a strategy: one record per strategy, read everywhere.

Nothing outside ``ddtrain.sync`` tests a strategy's name: the loop, checkpoints, the launcher,
the benchmarks and the report read these fields. Adding a strategy is a module that builds it
plus one ``register_strategy(StrategySpec(...))`` line (``ddtrain.sync.STRATEGIES``).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable


# A spec lists the SyncOptions fields its strategy reads (``options``); ``ddtrain.sync.check_options``
# refuses the others when they are set, so a new field is refused by every strategy until a spec
# claims it. Read by every strategy: the replica check's interval, and DDP's own arguments, which
# configure DDP where a strategy wraps the model in it and change nothing elsewhere (a script that
# loops over strategies passes them to all; SyncBatchNorm, which needs DDP's step, is an option).
READ_BY_ALL = ("check_every", "bucket_cap_mb", "find_unused_parameters", "static_graph", "gradient_as_bucket_view",
               "no_broadcast_buffers")
LOCAL_SGD_OPTIONS = ("outer_optimizer", "outer_lr", "outer_momentum", "local_sgd_warmup_steps", "adaptive_interval",
                     "adaptive_min_interval", "adaptive_max_interval", "adaptive_comm_fraction", "adaptive_max_divergence")
AUTO_OPTIONS = ("auto_allow", "auto_candidates", "auto_trial_steps", "auto_recheck")


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """One synchronisation strategy, as every other package sees it."""

    name: str                       # the --strategy word
    build: Callable                 # (model, optimizer, SyncOptions) -> a Strategy (ddtrain.sync.base); world size > 1
    summary: str                    # one line for --help and docs
    replicated: bool = True         # replicas bitwise identical after every step (checked; one checkpoint for all)
    sync_in_backward: bool = False  # the gradient all-reduce runs inside backward (DDP and its hooks)
    uses_servers: bool = False      # the last --servers ranks hold parameters instead of training
    checkpointable: bool = True     # the training loop holds all of its state (checkpoints can resume it)
    synchronous: bool = True        # R ranks x batch B take the steps of one process with batch R*B
    periodic: bool = False          # reads --sync-every (steps between parameter syncs)
    algorithm: str | None = None    # the ddtrain.comm algorithm whose cost model predicts its gradient sync
    options: tuple[str, ...] = ()   # the SyncOptions fields it reads besides READ_BY_ALL (others are refused)
    # what it sends, as the adviser (ddtrain advise, ddtrain.costmodel.advise) predicts it: "gradient" (DDP's buckets,
    # all-reduced with `algorithm` every step), "average" (the parameters, all-reduced with `averaging_algorithm`
    # every --sync-every steps), "sharded" (the `sharded_collectives` over the whole model every step, after
    # backward), or "" (not predicted; `not_predicted` says why)
    sends: str = ""
    averaging_algorithm: str | None = None   # the ddtrain.comm algorithm of its parameter averaging (sends="average")
    not_predicted: str = ""                  # why the adviser leaves it out (sends="")
    # sends="sharded": each step's collectives over the whole model, "allreduce" (a reduce-scatter and an all-gather
    # with `algorithm`: the all-reduce's schedule) or "allgather" (the parameters, the ring's R-1 steps)
    sharded_collectives: tuple[str, ...] = ()
    shards: tuple[str, ...] = ()    # what it splits over the ranks: "parameters", "gradients", "optimizer_state"
    sharded: bool = False           # optimizer state split over the ranks: optimizer.state_dict() is collective (gathers it)
    check: Callable | None = None   # (SyncOptions) -> None: raises ConfigError for values of its options it cannot run with

    def takes_option(self, name: str) -> bool:
        """Does this strategy read SyncOptions field ``name``?"""
        return name in self.options or name in READ_BY_ALL

    def advice_info(self, outers: tuple[str, ...]):
        """The adviser's view of this strategy (``ddtrain.costmodel.advise.StrategyInfo``), or None for ``sends=""``.

        One mapping for ``ddtrain advise`` (bench.advise) and ``--strategy auto`` (sync.auto). ``outers``: the
        outer steps local SGD can take (the values of ``SyncOptions.outer_optimizer``).
        """
        from ddtrain.costmodel.advise import StrategyInfo
        from ddtrain.errors import DDTrainError
        if self.sends == "gradient":
            return StrategyInfo(name=self.name, algorithm=self.algorithm, kind="gradient",
                                compressible=self.takes_option("compression"))
        if self.sends == "average":
            return StrategyInfo(name=self.name, algorithm=self.averaging_algorithm, kind="average",
                                outers=outers if self.takes_option("outer_optimizer") else ("average",))
        if self.sends == "sharded":
            return StrategyInfo(name=self.name, algorithm=self.algorithm, kind="sharded", compressible=False,
                                sharded=self.sharded_collectives, shards=self.shards)
        if self.sends == "":
            return None
        raise DDTrainError(f"strategy {self.name!r}: StrategySpec.sends must be 'gradient', 'average', 'sharded' or '', "
                           f"got {self.sends!r}")

    def extra_ranks(self, servers: int) -> int:
        """Ranks the strategy needs besides the workers (parameter servers)."""
        return servers if self.uses_servers else 0
