"""What a launch from this machine starts, checked before any worker: the launch policy of every launching command.

``ddtrain train`` and ``ddtrain run`` describe their launch as a ``LaunchSpec`` (workers here,
N or MIN:MAX; nodes, N or MIN:MAX; node rank, endpoint, restarts, checkpoint directory, global
batch, server ranks); ``plan_launch`` refuses what cannot run, in one line naming the flag, and
decides the sizes the job may run at; ``LaunchPlan.start`` starts it: one torchrun job
(``launch.run_local``, on one node or several) or, for ``--nproc MIN:MAX``, a job that goes on
with fewer workers when some are lost (``launch.run_elastic``).

Two rules belong to the caller, passed in as functions, since they need packages above this one:
``fits(workers, resuming)`` (can that many workers share the global batch? ddtrain train asks
its recipe, which may re-choose --grad-accum on a resume; the default is "it divides by them")
and ``joining(checkpoint_dir)`` (does the directory hold a running job of this run, which a new
node's workers join by resuming? ddtrain train asks reliability's checkpoint ownership).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from ddtrain.distributed.config import DistConfig
from ddtrain.errors import ConfigError, DDTrainError

Fits = Callable[[int, bool], bool]     # (workers, resuming) -> can they share the global batch?


@dataclass(kw_only=True)
class LaunchSpec:
    """One launch from this machine, as asked (every field is a flag of ddtrain train and ddtrain run)."""

    nproc: int = 1                       # workers this launcher starts (MAX of --nproc MIN:MAX)
    min_nproc: int | None = None         # the fewest it goes on with after losing some (None: nproc; MIN of MIN:MAX)
    dist: DistConfig = field(default_factory=DistConfig)   # --nnodes N|MIN:MAX, --node-rank, --rdzv-endpoint, --backend
    max_restarts: int = 0                # restarts of all workers after a failure (or a node joining or lost)
    checkpoint_dir: str | None = None    # where the workers' state lives; needed by any change of size
    resume: bool = False                 # the workers resume already (a joining node need not make them)
    global_batch_size: int = 0           # samples per optimizer update over all workers, kept by a resize (0: not stated)
    grad_accum: int | None = None        # named beside the global batch in messages (ddtrain train's --grad-accum)
    worker_batch: str = "--batch-size"   # how messages name the per-worker batch
    strategy: str | None = None          # named in messages about server ranks
    server_ranks: int = 0                # ranks of the job that are not workers (parameter servers)
    preempt_signals: tuple[str, ...] = ()   # besides SIGTERM and SIGINT, the signals the workers save and stop on
    preempt_grace_s: float = 120.0       # the workers' time to finish the step and save after a stop signal
    requeue: bool = False                # under SLURM, requeue the job after a preemption checkpoint
    resume_hint: str = "run the same command with --resume to continue"   # said after a preemption checkpoint

    def __post_init__(self):
        if self.min_nproc is None:
            self.min_nproc = self.nproc
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", f"must be >= 0, got {self.max_restarts}")
        if self.global_batch_size < 0:
            raise ConfigError("global_batch_size", f"must be a non-negative integer, got {self.global_batch_size}")

    @property
    def elastic_nodes(self) -> bool:
        """``--nnodes MIN:MAX`` with MIN < MAX: the job goes on with fewer nodes, or takes new ones in."""
        return self.dist.min_nodes < self.dist.max_nodes

    @property
    def elastic_workers(self) -> bool:
        """``--nproc MIN:MAX`` with MIN < MAX: a local job that goes on with fewer workers."""
        return self.min_nproc < self.nproc

    def divides(self, workers: int, resuming: bool = False) -> bool:
        """The default ``fits``: the global batch divides by the workers."""
        return self.global_batch_size % workers == 0

    def elastic_sizes(self, least: int, most: int, fits: Fits | None = None, flag: str | None = None) -> list[int]:
        """The world sizes in ``least..most`` this job can run at with its global batch unchanged, largest first.

        A resize keeps the global batch, so a size whose workers cannot share it (``fits``) is
        skipped; none at all is refused, and so is a MAX that cannot start, naming the sizes that would do.
        """
        fits = fits or self.divides
        servers = self.server_ranks
        flag = flag or f"--nproc {least}:{most}"
        if not self.global_batch_size:
            raise DDTrainError(f"{flag} needs --global-batch-size: without it the global batch is "
                               f"{self.worker_batch} x workers and would change with every resize (so would the "
                               f"training)")
        if least - servers < 1:
            raise DDTrainError(f"{flag}: --strategy {self.strategy} has {servers} server rank(s), so "
                               f"MIN must be at least {servers + 1} (one worker)")
        # the first attempt runs the flags as given; later ones resume (ddtrain train may re-choose --grad-accum)
        sizes = [n for n in range(most, least - 1, -1) if fits(n - servers, n != most)]
        if sizes and sizes[0] != most or not sizes:
            would = [n for n in range(1, 4 * most + 1) if fits(n - servers, True)][:12]
            what = "runs on none of them" if not sizes else f"cannot start on {most}"
            accum = f" (--grad-accum {self.grad_accum})" if self.grad_accum is not None else ""
            raise DDTrainError(f"{flag}: --global-batch-size {self.global_batch_size}{accum} {what}; world sizes "
                               f"that can share it: {', '.join(map(str, would)) or 'none'}")
        return sizes


@dataclass(frozen=True)
class LaunchPlan:
    """A launch checked and decided: what ``start`` runs."""

    sizes: tuple[int, ...]               # the world sizes on this machine, largest first
    limits: tuple[int, int]              # (MIN, MAX) of --nproc; MIN < MAX: a lost worker means going on with fewer
    nodes: tuple | None                  # (nnodes, node rank, endpoint) of a multi-node launch, else None
    max_restarts: int
    joining: bool                        # this node joins a running job: its workers must resume
    server_ranks: int = 0
    preempt: object = None               # launch.PreemptPolicy when the workers save their state on a stop signal

    @property
    def workers(self) -> int:
        """The workers of the first attempt on this machine (its ranks less the servers)."""
        return self.sizes[0] - self.server_ranks

    def start(self, argv: list[str], *, module: str = "ddtrain", env: dict | None = None) -> int:
        """Run ``python -m <module> <argv>`` on this plan's workers; the job's exit status."""
        from ddtrain.distributed import launch
        if self.limits[0] < self.limits[1]:   # even where only MAX can share the global batch: it says so at a loss
            return launch.run_elastic(list(self.sizes), argv, max_restarts=self.max_restarts, env=env, module=module,
                                      limits=self.limits, preempt=self.preempt)
        return launch.run_local(self.sizes[0], argv, max_restarts=self.max_restarts, env=env, module=module,
                                nodes=self.nodes, preempt=self.preempt)


def plan_launch(spec: LaunchSpec, *, fits: Fits | None = None,
                joining: Callable[[str], bool] | None = None) -> LaunchPlan:
    """Check ``spec`` (DDTrainError, one line naming the flag) and decide what runs; nothing starts here.

    ``fits(workers, resuming)``: can that many workers share the global batch (default: it divides
    by them). ``joining(checkpoint_dir)``: does the directory hold a running job of this run
    (default: never), so that a node started with ``--nnodes MIN:MAX`` joins it and resumes.
    The only effects: a multi-node launch sets the run id all its nodes share (``env.share_run_id``),
    and a joining node prints a note.
    """
    import torch
    nproc, dist, servers = spec.nproc, spec.dist, spec.server_ranks
    if nproc < 1:
        raise DDTrainError(f"--nproc must be at least 1, got {nproc}")
    if servers and nproc - servers < 1:
        raise DDTrainError(f"--strategy {spec.strategy} with --servers {servers} needs --nproc of at least "
                           f"{servers + 1} (one worker)")
    if dist.backend == "nccl" and torch.cuda.device_count() < nproc:
        raise DDTrainError(f"--backend nccl needs a GPU per worker: {nproc} workers, "
                           f"{torch.cuda.device_count()} GPU(s) visible")
    if spec.elastic_nodes and not spec.max_restarts:
        raise DDTrainError(f"--nnodes {dist.nnodes} needs --max-restarts of at least 1: torchrun's agents "
                           f"re-form the job at the new size by restarting the workers")
    if (spec.elastic_nodes or spec.elastic_workers) and not spec.checkpoint_dir:
        flag = f"--nnodes {dist.nnodes}" if spec.elastic_nodes else f"--nproc {spec.min_nproc}:{nproc}"
        raise DDTrainError(f"{flag} needs --checkpoint-dir DIR: after a change of size the workers go on from "
                           f"the last checkpoint written there")
    if spec.elastic_nodes:  # every node count in MIN..MAX must be able to share the global batch
        sizes = spec.elastic_sizes(dist.min_nodes * nproc, dist.max_nodes * nproc, fits,
                                   flag=f"--nnodes {dist.nnodes} with --nproc {nproc}")
        short = [k for k in range(dist.min_nodes, dist.max_nodes + 1) if k * nproc not in sizes]
        if short:
            raise DDTrainError(f"--nnodes {dist.nnodes}: --global-batch-size {spec.global_batch_size} cannot "
                               f"be shared by {', '.join(map(str, short))} node(s) of {nproc} workers; world "
                               f"sizes that can: {', '.join(map(str, sorted(sizes)))}")
    local_sizes = [nproc]
    if spec.elastic_workers:
        if dist.max_nodes > 1:
            raise DDTrainError(f"--nproc {spec.min_nproc}:{nproc} is for one machine; across nodes give the "
                               f"range of nodes instead (--nnodes MIN:MAX) and --nproc the workers of each")
        local_sizes = spec.elastic_sizes(spec.min_nproc, nproc, fits)
    elif not spec.elastic_nodes and fits is None and spec.global_batch_size:
        # a fixed size; a caller with a rule of its own (ddtrain train's recipe) checks it itself, in its own words
        workers = dist.max_nodes * nproc - servers
        if not spec.divides(workers):
            can = [n for n in range(1, spec.global_batch_size + 1) if spec.divides(n)][:12]
            raise DDTrainError(f"--global-batch-size {spec.global_batch_size} cannot be shared by {workers} "
                               f"worker(s); worker counts that can: {', '.join(map(str, can))}")
    if dist.max_nodes > 1:  # the launchers of all nodes are one run (one checkpoint directory and lineage)
        from ddtrain.distributed.env import share_run_id
        share_run_id(dist.rdzv_endpoint)
    joins = False
    # checkpoints written, the directory held by another node's launcher of this run: the job runs already
    if spec.elastic_nodes and not spec.resume and joining is not None and joining(spec.checkpoint_dir):
        # a node joining the running job (same run id): its workers take the job's state, they do not start one
        print(f"ddtrain: note: --checkpoint-dir {spec.checkpoint_dir} is held by this job's other "
              f"nodes; joining the running job", file=sys.stderr, flush=True)
        joins = True
    nodes = (dist.nnodes, dist.node_rank, dist.rdzv_endpoint) if dist.max_nodes > 1 else None
    preempt = None
    if spec.checkpoint_dir:  # the workers can save their state: give them the time to, and say where it is
        from ddtrain.distributed.launch import PreemptPolicy
        preempt = PreemptPolicy(signals=tuple(spec.preempt_signals), grace_s=spec.preempt_grace_s,
                                requeue=spec.requeue, resume_hint=spec.resume_hint)
    return LaunchPlan(sizes=tuple(local_sizes), limits=(spec.min_nproc, nproc), nodes=nodes,
                      max_restarts=spec.max_restarts, joining=joins, server_ranks=servers, preempt=preempt)
