"""What the rest of ddtrain knows about a strategy: one record per strategy, read everywhere.

Nothing outside ``ddtrain.sync`` tests a strategy's name: the loop, checkpoints, the launcher,
the benchmarks and the report read these fields. Adding a strategy is a module that builds it
plus one ``register_strategy(StrategySpec(...))`` line (``ddtrain.sync.STRATEGIES``).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable


# SyncOptions fields that only some strategies read (their specs list them in ``options``); the
# rest (the DDP options, check_every) are accepted by every strategy.
LOCAL_SGD_OPTIONS = ("outer_optimizer", "outer_lr", "outer_momentum", "local_sgd_warmup_steps", "adaptive_interval",
                     "adaptive_min_interval", "adaptive_max_interval", "adaptive_comm_fraction", "adaptive_max_divergence")
STRATEGY_SPECIFIC = frozenset({"sync_every", "servers", "staleness", "timeout_s", "compression", *LOCAL_SGD_OPTIONS})


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
    options: tuple[str, ...] = ()   # the strategy-specific SyncOptions fields it reads (others refuse them)
    # what it sends, as the adviser (ddtrain advise, ddtrain.costmodel.advise) predicts it: "gradient" (DDP's buckets,
    # all-reduced with `algorithm` every step), "average" (the parameters, all-reduced with `averaging_algorithm`
    # every --sync-every steps), or "" (not predicted; `not_predicted` says why)
    sends: str = ""
    averaging_algorithm: str | None = None   # the ddtrain.comm algorithm of its parameter averaging (sends="average")
    not_predicted: str = ""                  # why the adviser leaves it out (sends="")

    def takes_option(self, name: str) -> bool:
        """Does this strategy read SyncOptions field ``name``? (Fields no strategy claims are read by all.)"""
        return name in self.options or name not in STRATEGY_SPECIFIC

    def extra_ranks(self, servers: int) -> int:
        """Ranks the strategy needs besides the workers (parameter servers)."""
        return servers if self.uses_servers else 0
