"""Start N local worker processes through torch.distributed.run (torchrun's own machinery).

``ddtrain <command> --nproc N`` calls ``run_local(N, argv)`` when no launcher environment is
present: torchrun's elastic agent then starts ``python -m ddtrain <argv>`` N times with
RANK/WORLD_SIZE/MASTER_* set, on 127.0.0.1 and a free port, restarting all of them up to
``max_restarts`` times after a failure. The workers' stderr goes to log files (torchrun's
``--redirects``): their own notes are passed on as they come, and when the job fails the
launcher prints one line, the first cause's message, naming the file that holds everything.
Each worker dies with the launcher, however the launcher dies (``die_with_launcher``).
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass

from ddtrain.errors import DDTrainError

# A rank that stops because rank 0 reports the problem (once) exits with this status, silently.
PEER_STOPPED_EXIT = 4
LOST_PEER_EXIT = 5       # a rank whose connection to a failed peer broke (cli._report_unexpected)
# Stopped by a preemption signal, every rank after the same step, with its state saved: run it again to
# continue (sysexits.h's EX_TEMPFAIL, "try again later"; distinct from the failures above and 128 + N).
PREEMPTED_EXIT = 75
# Where each node's workers tell their launcher at which step they stopped and which checkpoint holds it
# (JSON, written atomically by the node's local rank 0; ddtrain.reliability.preemption.write_report).
PREEMPT_REPORT_ENV = "DDTRAIN_PREEMPT_REPORT"
# The signals besides SIGTERM and SIGINT that stop the workers with a checkpoint (--preempt-signal), for scripts.
PREEMPT_SIGNAL_ENV = "DDTRAIN_PREEMPT_SIGNAL"


@dataclass(frozen=True)
class PreemptPolicy:
    """What a launcher does when its workers save their state on a stop signal (``--checkpoint-dir`` given).

    The launcher forwards the signal to its workers (torchrun's agent does, for SIGTERM, SIGINT,
    SIGHUP and SIGQUIT; ``signals`` adds more, such as SIGUSR1), gives them ``grace_s`` seconds to
    finish their step and save before it kills them (torchrun's own is 30 s), ignores a second
    signal meanwhile (a third stops at once), then reports where they stopped and exits with
    ``PREEMPTED_EXIT``; under SLURM with ``requeue`` it requeues the job first.
    """

    signals: tuple[str, ...] = ()      # signal names handled besides torchrun's own four
    grace_s: float = 120.0             # the workers' time from the signal to their end, before SIGKILL
    requeue: bool = False              # under SLURM, after a checkpoint was written: scontrol requeue
    resume_hint: str = "run the same command with --resume to continue"
LAUNCHER_PID_ENV = "DDTRAIN_LAUNCHER_PID"   # set by run_local for its workers (die_with_launcher)
# Why the workers were (re)started at their size, for the membership record (reliability.ownership).
MEMBERSHIP_REASON_ENV = "DDTRAIN_MEMBERSHIP_REASON"


def inside_launcher() -> bool:
    """True when a launcher (torchrun, srun, mpirun) already started this process as a rank."""
    from ddtrain.distributed.env import launched  # an sbatch batch shell has SLURM_PROCID too, but is no task
    return launched()


def stale_launch_variables(environ=None) -> list[str]:
    """torchrun's rank variables set although no torchrun started this process (left in the shell by an earlier job)."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or env.get("TORCHELASTIC_RUN_ID"):
        return []
    from ddtrain.distributed.env import LAUNCHERS
    torchrun = LAUNCHERS["torchrun"]  # its per-rank variables: stale in a process no torchrun started
    names = (torchrun.rank, torchrun.world_size, torchrun.local_rank, *torchrun.local_world_size, *torchrun.also_sets)
    return [name for name in names if name in env and name not in ("MASTER_ADDR", "MASTER_PORT")]


def die_with_launcher() -> None:
    """In a worker run_local started: be killed with the launcher, however it ends (SIGKILL included).

    Linux's parent-death signal does it in the kernel; elsewhere a thread watches the parent.
    A launcher already gone before we asked means nobody waits for this worker: it exits.
    """
    try:
        launcher = int(os.environ.get(LAUNCHER_PID_ENV, ""))
    except ValueError:
        return
    if os.getppid() != launcher:
        # torchrun starts each worker in a session of its own: a session leader whose parent is not the
        # launcher was reparented, so the launcher died before this worker got here (issue 32: a launcher
        # killed while its workers imported torch left both running, since its pid, a zombie its own
        # parent had not reaped yet, still answered os.kill(pid, 0)).
        if os.getsid(0) == os.getpid() or not _alive(launcher):
            os._exit(1)
        return  # a process started further down (not by torchrun's agent): not ours to tie
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0:
                if os.getppid() != launcher:  # it died between the first check and prctl
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_watch_parent, args=(launcher,), daemon=True, name="ddtrain-launcher-watch").start()


def _alive(pid: int) -> bool:
    from ddtrain.distributed.processes import running
    return running(pid)


def _watch_parent(launcher: int) -> None:
    import time
    while os.getppid() == launcher:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the kernel says is free right now (for the rendezvous store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def strip_option(argv: list[str], name: str) -> list[str]:
    """``argv`` without ``name VALUE`` / ``name=VALUE`` (workers must not launch again)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == name:
            skip = True
        elif not item.startswith(name + "="):
            out.append(item)
    return out


def count_reforms() -> None:
    """In a torchrun agent: count every restart of its workers (a failure, or a node joining) in DDTRAIN_REFORMS.

    The workers inherit the agent's environment when started, and take the count as their
    attempt (rendezvous.add_attempt_base), so a job re-formed for a new node resumes.
    """
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from ddtrain.distributed.rendezvous import REFORMS_ENV
    original = SimpleElasticAgent._restart_workers
    if getattr(original, "counts_reforms", False):
        return

    def restart_workers(self, worker_group):
        os.environ[REFORMS_ENV] = str(int(os.environ.get(REFORMS_ENV, "0") or 0) + 1)
        return original(self, worker_group)
    restart_workers.counts_reforms = True
    SimpleElasticAgent._restart_workers = restart_workers


def run_local(nproc: int, argv: list[str], *, max_restarts: int = 0, env: dict | None = None,
              module: str = "ddtrain", nodes: tuple | None = None, outcome: dict | None = None,
              preempt: PreemptPolicy | None = None) -> int:
    """Run ``python -m <module> <argv>`` as ``nproc`` ranks; the job's exit status (128 + N when signal N stopped it).

    With ``outcome`` (a dict) a failed job prints nothing: ``outcome`` gets its first cause
    (``rank``, ``exitcode``, ``what``: a few words, ``line``: the line run_local would print) and
    ``lost``, the ranks killed by a signal other than the agent's SIGTERM (run_elastic reads them).
    With ``preempt`` the workers may stop on a signal with their state saved: one line says
    where, and the status is ``PREEMPTED_EXIT`` (``PreemptPolicy``).
    """
    if nproc < 1:
        raise DDTrainError(f"--nproc must be at least 1, got {nproc}")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    cores = os.cpu_count() or 1
    # Our choice is per launch (a demo launches 1, 2, then 4 workers from one process); a value
    # the user set before ddtrain started is theirs and stays.
    if "OMP_NUM_THREADS" not in os.environ or os.environ.get("DDTRAIN_SET_OMP_NUM_THREADS") == "1":
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
        os.environ["DDTRAIN_SET_OMP_NUM_THREADS"] = "1"
    os.environ.update(env or {})
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    debug = bool(os.environ.get("DDTRAIN_DEBUG"))
    if not debug:
        # torchelastic's loggers carry levels of their own (LOGLEVEL): the agent's notes, such as
        # "Received 2 death signal", would print around ddtrain's one line.
        for name in ["torch.distributed", *logging.root.manager.loggerDict]:
            if name.startswith("torch.distributed"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
        if os.environ.pop("DDTRAIN_SET_CPP_LOG_LEVEL", None):  # cli.main quietened C++ logs here, not in the log files
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
    logs = None if debug else WorkerLogs()
    notice = _RestartNotice(max_restarts, logs)
    port = free_port()
    if max_restarts:
        # The static rendezvous keeps one store for every attempt, so a restarted process group
        # finds the dead attempt's addresses there and cannot connect. The c10d rendezvous with
        # its store not shared gives each attempt a fresh store (hosted by the new rank 0).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1"]
    else:
        rendezvous = ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    if nodes is not None:  # ddtrain train --nnodes N --node-rank I --rdzv-endpoint HOST:PORT (env.node_rendezvous)
        from ddtrain.distributed.env import node_rendezvous
        rendezvous = node_rendezvous(*nodes, max_restarts=max_restarts)
        if ":" in str(nodes[0]):  # --nnodes MIN:MAX: notice a lost node within seconds
            rendezvous = elastic_conf(rendezvous)
    args = _torchrun_parser().parse_args(["--nnodes", "1", "--nproc-per-node", str(nproc), *rendezvous,
                       "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
                       *([] if logs is None else ["--log-dir", logs.root, "--redirects", "2"]),
                       "--module", module, *argv])
    failed, interrupted = True, False
    if max_restarts:
        count_reforms()
    stop = _StopSignals(preempt) if preempt is not None else None
    job = _Job(logs, preempt, nodes)
    try:
        job.start()
        if stop is not None:
            stop.start()
        run(args)
        failed = False
        if stop is not None and stop.report() is not None:   # a worker was signalled (not this launcher)
            return stop.finish(logs)
    except ChildFailedError as exc:
        said = (lambda local_rank: logs.message(local_rank)[0]) if logs is not None else None
        rank, failure = cause(exc.failures, said)
        if outcome is not None:
            detail = logs.message(failure.local_rank)[0] if logs is not None else None
            outcome.update(rank=rank, exitcode=failure.exitcode, line=failure_line(rank, failure, logs),
                           what=describe_failure(rank, failure.exitcode, detail, logs is None).split(";")[0],
                           lost=sorted(r for r, f in exc.failures.items() if _lost(f.exitcode)),
                           log_dir=logs.root if logs is not None else None)
            return failure.exitcode if failure.exitcode > 0 else 1
        print(failure_line(rank, failure, logs), file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as exc:  # torchrun's handler: it has stopped the workers with the same signal
        failed, interrupted = False, True
        if stop is not None and (stop.report() is not None or stop.error(logs)):
            failed = stop.report() is None
            return stop.finish(logs)
        return stopped_by(int(exc.sigval), job.killed_at)
    except KeyboardInterrupt:  # before torchrun's handler was in place
        failed, interrupted = False, True
        return stopped_by(signal.SIGINT, job.killed_at)
    finally:
        if stop is not None:
            stop.close()
        notice.close()
        job.close(succeeded=not failed and not interrupted and job.signals == 0)
        if logs is not None:   # a stopped job's tracebacks are the stop's consequences (Gloo's lost peers): not shown
            logs.close(keep=failed, show_held=not failed and not interrupted and job.signals == 0)
    return 0


class _Job:
    """One launch's processes (issue 32): marked, ended with the job, and its stop signals seen from a thread.

    Every worker and whatever it starts carries this launch's token (``processes.TOKEN_ENV``) and
    each worker's pid (its session) is noted as torchrun starts it, so that when the job ends (done,
    failed or stopped) nothing it started keeps running. Stop signals are counted by a thread
    (``processes.SignalWatch``): the second (the third with a checkpoint directory, whose second is
    the workers' time to save) kills the workers at once with SIGKILL; a signal while no worker runs
    and the launcher is blocked in torch's C++ (a rendezvous waiting for nodes that never come) ends
    the launcher with one line.
    """

    def __init__(self, logs, preempt, nodes):
        from ddtrain.distributed import processes
        self.logs, self.preempt, self.nodes = logs, preempt, nodes
        self.token = processes.new_token()
        self.sessions: list[int] = []
        self.signals = 0
        self.killed_at = 0      # the stop signal (1st, 2nd, ...) at which the workers were killed; 0: not
        self._restore: list = []
        self.watch = processes.SignalWatch(kill_after=3 if preempt is not None else 2, stuck=self._stuck,
                                           escalate=self._escalate, workers_alive=self._workers_alive)

    def start(self) -> None:
        from torch.distributed.elastic.multiprocessing import api
        from ddtrain.distributed.processes import TOKEN_ENV
        os.environ[TOKEN_ENV] = self.token
        try:
            from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
                SubprocessHandler)
        except ImportError:   # another torch: the token alone finds the job's processes
            SubprocessHandler = None
        if SubprocessHandler is not None and hasattr(SubprocessHandler, "_popen"):
            original, sessions = SubprocessHandler._popen, self.sessions

            def popen(handler, *a, **kw):
                proc = original(handler, *a, **kw)
                sessions.append(proc.pid)   # torchrun starts each worker in a session of its own (start_new_session)
                return proc
            self._restore.append((SubprocessHandler, "_popen", original))
            SubprocessHandler._popen = popen
        if threading.current_thread() is threading.main_thread():
            # SIGUSR1/SIGUSR2 end a launcher by default, leaving its folders behind; stop the job as SIGTERM does
            for number in (signal.SIGUSR1, signal.SIGUSR2):
                if signal.getsignal(number) in (signal.SIG_DFL, None):
                    self._restore.append((signal, number, signal.signal(
                        number, lambda signum, frame: api._terminate_process_handler(signum, frame))))
        self.watch.start()

    def _workers_alive(self) -> bool:
        from ddtrain.distributed.processes import running
        return any(running(pid) for pid in self.sessions)

    def _escalate(self, signum: int, count: int) -> None:
        from ddtrain.distributed.processes import end_job
        self.signals = max(self.signals, count)
        if not self.killed_at:
            self.killed_at = count
        end_job(self.token, self.sessions, grace_s=0)

    def _stuck(self, signum: int) -> None:
        """A stop signal, no worker running and the launcher still here: blocked in torch's C++; end now."""
        from ddtrain.distributed.processes import end_job
        self.signals = max(self.signals, 1)
        where = (f"waiting for the other nodes at {self.nodes[2]} (--rdzv-endpoint)" if self.nodes
                 else "after its workers ended" if self.sessions else "before its workers started")
        what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        print(f"ddtrain: {what} {where}; stopped", file=sys.stderr, flush=True)
        end_job(self.token, self.sessions, grace_s=0)
        if self.logs is not None:
            shutil.rmtree(self.logs.root, ignore_errors=True)
        preempt_folder = os.path.dirname(os.environ.get(PREEMPT_REPORT_ENV, "")) or None
        if preempt_folder:
            shutil.rmtree(preempt_folder, ignore_errors=True)
        os._exit(128 + int(signum))

    def close(self, succeeded: bool) -> None:
        from ddtrain.distributed.processes import TOKEN_ENV, describe, end_job
        self.signals = max(self.signals, self.watch.count)
        self.watch.close()
        self._restore = put_back(self._restore)
        left = end_job(self.token, self.sessions)   # a script's children, a rank's helpers: none outlives the job
        os.environ.pop(TOKEN_ENV, None)
        if left and succeeded:
            print(f"ddtrain: note: the job's workers left {len(left)} process(es) running ({describe(left)}); "
                  f"stopped them with the job", file=sys.stderr, flush=True)


def put_back(saved: list) -> list:
    """Undo what a launcher patched, newest first: ``(signal, number, handler)`` for a signal handler (None: the
    default), ``(object, attribute, value)`` for an attribute of torch's; the empty list, to keep in its place."""
    for owner, name, value in reversed(saved):
        if owner is signal:
            signal.signal(name, value if value is not None else signal.SIG_DFL)
        else:
            setattr(owner, name, value)
    return []


class _StopSignals:
    """The launcher's side of a preemption (``PreemptPolicy``): longer grace, repeated signals held, the report read.

    torchrun's agent turns a signal into ``SignalException`` (its handler, installed when the
    workers start) and then stops the workers with that signal, waiting 30 s before SIGKILL.
    Here its handler is wrapped, so that the first signal goes through, a second is only noted
    (the workers are saving) and a third goes through again (stop at once); extra signals
    (SIGUSR1) get the same handler; and the wait before SIGKILL becomes ``grace_s``.
    """

    def __init__(self, policy: PreemptPolicy):
        self.policy = policy
        self.received: list[tuple[int, float]] = []    # (signal, time.time()) as they came
        self.folder = tempfile.mkdtemp(prefix="ddtrain-preempt-")
        from ddtrain.distributed.processes import claim_folder
        claim_folder(self.folder)   # a launcher killed before close() leaves it: the next launch removes it
        self.path = os.path.join(self.folder, "report.json")
        os.environ[PREEMPT_REPORT_ENV] = self.path
        if policy.signals:
            os.environ[PREEMPT_SIGNAL_ENV] = ",".join(policy.signals)
        self._saved: list = []
        self.settled = False     # the workers stopped and saved: later signals (SLURM's, after a requeue) are only noted

    def start(self) -> None:
        from torch.distributed.elastic.multiprocessing import api
        original, close = api._terminate_process_handler, api.PContext.close
        me = self

        def handler(signum, frame):   # what torchrun's agent installs for its signals (it reads the module's name)
            me.received.append((signum, time.time()))
            if len(me.received) == 2 or me.settled:   # the workers are saving, or have saved: let them be
                return
            original(signum, frame)

        def close_with_grace(pcontext, death_sig=None, timeout=30):
            if me.received:
                timeout = max(timeout, me.policy.grace_s)
            return close(pcontext, death_sig, timeout)
        self._saved = [(api, "_terminate_process_handler", original), (api.PContext, "close", close)]
        api._terminate_process_handler, api.PContext.close = handler, close_with_grace
        for name in self.policy.signals:  # torchrun before 2.9 handles none but its four; from 2.9 only when asked
            number = getattr(signal, name)
            self._saved.append((signal, number, signal.signal(number, handler)))

    def close(self) -> None:
        self._saved = put_back(self._saved)
        for name in (PREEMPT_REPORT_ENV, PREEMPT_SIGNAL_ENV):
            os.environ.pop(name, None)
        shutil.rmtree(self.folder, ignore_errors=True)

    def report(self) -> dict | None:
        try:
            with open(self.path) as f:
                found = json.load(f)
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    def error(self, logs) -> str | None:
        """A worker's error line (a save that failed during the stop), for the one line the launcher prints."""
        if logs is None:
            return None
        logs.poll()
        with logs.lock:
            lines = sorted(logs.errors.items())
        return next((line for _, line in lines if "ddtrain: error:" in line), None)

    def finish(self, logs) -> int:
        """The one line after the workers stopped on a signal, the requeue, and the exit status."""
        self.settled = True
        report = self.report()
        if report is None:
            print(_bare_error(self.error(logs)), file=sys.stderr, flush=True)
            return 1
        name = signal.Signals(self.received[0][0]).name if self.received else None
        return report_preemption(report, self.policy, signal_name=name,
                                 signal_at=self.received[0][1] if self.received else None)


def report_preemption(report: dict, policy: PreemptPolicy, *, signal_name: str | None = None,
                      signal_at: float | None = None) -> int:
    """Print the one line of a job whose workers stopped on a signal, requeue it if asked; ``PREEMPTED_EXIT``.

    ``report``: what the workers said (``reliability.preemption.write_report``: step, checkpoint,
    saved, signal, signal_at, written_at, rank). ``signal_name``/``signal_at``: the launcher's own
    signal, when it got one (else the workers'). Called by the launcher, or by rank 0 when a
    launcher of its own (srun, torchrun) started it.
    """
    name = signal_name or report.get("signal") or "a signal to a worker"
    began = signal_at or report.get("signal_at")
    step, path = report.get("step"), report.get("checkpoint")
    if report.get("saved"):
        took = f" {report['written_at'] - began:.2f} s after the signal" if began and report.get("written_at") else ""
        line = f"ddtrain: stopped by {name}: every worker finished step {step}; checkpoint {path} written{took}"
    else:
        line = f"ddtrain: stopped by {name} at step {step}, before training further: nothing new to save"
        line += f" (the newest checkpoint is {path})" if path else " (no checkpoint yet)"
    from ddtrain.distributed.job import requeue_slurm_job, slurm_job_id
    job = slurm_job_id()
    if policy.requeue and job and report.get("saved") and report.get("rank") == 0:
        print(line + f"; requeueing SLURM job {job}: it resumes from there by itself", file=sys.stderr, flush=True)
        problem = requeue_slurm_job(job)   # SLURM stops this run now: the line is out first
        if problem is not None:
            print(f"ddtrain: warning: could not requeue SLURM job {job} ({problem}); {policy.resume_hint}",
                  file=sys.stderr, flush=True)
        return PREEMPTED_EXIT
    hint = policy.resume_hint if path else "nothing to resume from yet: run the same command again to start over"
    print(f"{line}; {hint}", file=sys.stderr, flush=True)
    return PREEMPTED_EXIT


def _bare_error(line: str | None) -> str:
    if not line:
        return "ddtrain: error: the workers stopped on a signal without saving their state"
    return "ddtrain: error: " + _bare(line)


def _lost(exitcode: int) -> bool:
    """A worker gone by a signal (SIGKILL: the OOM killer, kill -9; SIGSEGV...), not the agent's or the user's stop."""
    return exitcode < 0 and -exitcode not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def run_elastic(sizes: list[int], argv: list[str], *, max_restarts: int = 0, env: dict | None = None,
                module: str = "ddtrain", limits: tuple[int, int] | None = None,
                preempt: PreemptPolicy | None = None) -> int:
    """``ddtrain train --nproc MIN:MAX``: run on the largest of ``sizes``; a worker lost goes on with fewer.

    Each attempt is one ``run_local`` at a fixed size. When workers are killed by a signal (the
    OOM killer, ``kill -9``, a crash) the job starts again on the largest allowed size that the
    survivors make up (``sizes`` holds the world sizes the configuration can run at, MIN..MAX), and
    the workers resume from the last checkpoint (their attempt number continues:
    DDTRAIN_ATTEMPT_BASE). Below the smallest size it stops. A worker that fails with an error
    of its own is restarted at the same size while ``max_restarts`` allows (as run_local does).
    Workers are never added back: a local launcher has no new machines to wait for.
    """
    from ddtrain.distributed.rendezvous import ATTEMPT_BASE_ENV
    sizes = sorted(set(sizes), reverse=True)
    low, high = limits or (sizes[-1], sizes[0])
    size, attempt, restarts, reason = sizes[0], 0, 0, ""
    while True:
        outcome: dict = {}
        code = run_local(size, argv, env={**(env or {}), ATTEMPT_BASE_ENV: str(attempt), MEMBERSHIP_REASON_ENV: reason},
                         module=module, outcome=outcome, preempt=preempt)
        if not outcome:  # finished, stopped by the user (Ctrl-C, SIGTERM) or preempted: run_local said so
            return code
        attempt += 1
        if outcome["lost"]:
            left = size - len(outcome["lost"])
            fits = [n for n in sizes if n <= left]
            if not fits:
                print(f"{outcome['line']}; {left} worker(s) left, fewer than the {low} that --nproc {low}:{high} "
                      f"needs at least" + (f" (sizes this run can use: {', '.join(map(str, sorted(sizes)))})"
                                           if len(sizes) < high - low + 1 else ""), file=sys.stderr, flush=True)
                return code
            reason = f"{outcome['what']}: world size {size} -> {fits[0]}"
            if outcome.get("log_dir"):  # this attempt's failure is handled: its workers' logs are not needed
                shutil.rmtree(outcome["log_dir"], ignore_errors=True)
            print(f"ddtrain: {outcome['what']}; going on with {fits[0]} workers (--nproc {low}:{high}) from the "
                  f"last checkpoint", file=sys.stderr, flush=True)
            size = fits[0]
            continue
        if restarts >= max_restarts:
            print(outcome["line"], file=sys.stderr, flush=True)
            return code
        restarts += 1
        reason = f"{outcome['what']}: restart {restarts} of {max_restarts} at world size {size}"
        print(f"ddtrain: {outcome['what']}; restarting all workers (restart {restarts} of {max_restarts})",
              file=sys.stderr, flush=True)


# torchrun's c10d rendezvous for --nnodes MIN:MAX. A node that stops sending heartbeats is dropped
# after interval x attempts (3 s; torch's default is 15 s), and once MIN nodes are in, the others
# get last_call more seconds to join (torch's default 30 s) before the job re-forms without them.
ELASTIC_RDZV_CONF = {"last_call_timeout": "5", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}


def elastic_conf(rendezvous: list[str], conf: dict | None = None) -> list[str]:
    """torchrun rendezvous arguments with ELASTIC_RDZV_CONF added to ``--rdzv-conf`` (values given there win)."""
    out, given = list(rendezvous), {}
    if "--rdzv-conf" in out:
        i = out.index("--rdzv-conf")
        given = dict(item.split("=", 1) for item in out[i + 1].split(",") if "=" in item)
        del out[i:i + 2]
    merged = {**(conf or ELASTIC_RDZV_CONF), **given}
    return [*out, "--rdzv-conf", ",".join(f"{k}={v}" for k, v in merged.items())]


def stopped_by(signum: int, killed_at: int = 0) -> int:
    """One line for a job stopped by a signal (Ctrl-C, SIGTERM); the exit status a shell gives it (128 + N).

    ``killed_at``: the repeated signal (2nd, 3rd) at which the launcher killed workers that had not
    stopped (``_Job``), 0 when they stopped by themselves.
    """
    name = signal.Signals(signum).name
    what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {name}"
    if killed_at:
        nth = {2: "second", 3: "third"}.get(killed_at, f"{killed_at}th")
        print(f"ddtrain: {what}; the workers had not stopped by the {nth} signal and were killed (SIGKILL)",
              file=sys.stderr, flush=True)
    else:
        print(f"ddtrain: {what}; the workers were stopped", file=sys.stderr, flush=True)
    return 128 + int(signum)


def failure_line(rank: int, failure, logs) -> str:
    """The one line a failed job prints: the first cause's own message, or what happened to it, and its log."""
    line, path = logs.message(failure.local_rank) if logs is not None else (None, None)
    where = f" (rank {rank}'s full output: {path})" if path else ""
    if line and "ddtrain: error:" in line:
        return line + where
    return f"ddtrain: error: {describe_failure(rank, failure.exitcode, line, logs is None)}{where}"


# A rank's own words when it lost a peer that failed first (Gloo's and the store's): its failure is a consequence.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ECONNRESET",
             "connection refused", "Socket closed")


def _priority(exitcode: int, message: str | None = None) -> int:
    """Which failure caused the others: a signal other than the agent's SIGTERM, then an error status,
    then a rank that failed with an error of its own (1), then one that lost its peers (by its exit
    status, or by its last words: a script's rank 0 dies on Gloo's "Connection closed by peer" when
    rank 1 raised) or stopped for rank 0's report, then SIGTERM."""
    if exitcode < 0:
        return 4 if -exitcode == signal.SIGTERM else 0
    if message and any(p.lower() in message.lower() for p in PEER_LOST):
        return 3
    return {1: 2, LOST_PEER_EXIT: 3, PEER_STOPPED_EXIT: 3}.get(exitcode, 1)


def cause(failures: dict, said=None):
    """(rank, failure) that most likely started a failed job (torchrun's timestamps are whole seconds).

    ``said(local_rank)``: that worker's last error line, if known (``WorkerLogs.message``).
    """
    order = {r: i for i, r in enumerate(failures)}  # torchrun lists them in the order it saw them fail

    def key(r):
        failure = failures[r]
        return _priority(failure.exitcode, said(failure.local_rank) if said else None), failure.timestamp, order[r]
    rank = min(failures, key=key)
    return rank, failures[rank]


class _RestartNotice(logging.Handler):
    """Turns torchrun's own log records into one line when it restarts the workers."""

    PROC_LOGGER = "torch.distributed.elastic.multiprocessing.api"
    AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"

    def __init__(self, max_restarts: int, logs=None):
        super().__init__(logging.INFO)
        self.max_restarts, self.last, self.logs = max_restarts, None, logs
        self.loggers = [logging.getLogger(name) for name in (self.PROC_LOGGER, self.AGENT_LOGGER)] \
            if max_restarts > 0 and not os.environ.get("DDTRAIN_DEBUG") else []
        self.saved = [(lg.level, lg.propagate) for lg in self.loggers]
        for lg in self.loggers:
            lg.setLevel(logging.INFO)
            lg.propagate = False
            lg.addHandler(self)

    def emit(self, record) -> None:
        msg = str(record.msg)
        if msg.startswith("failed (exitcode"):
            self.last = (record.args[1], record.args[0])  # (local rank, exit code)
        elif "attempts left" in msg:
            left = record.args[2]
            detail = self.logs.message(self.last[0])[0] if self.logs is not None and self.last else None
            what = describe_failure(*self.last, detail, self.logs is None).split(";")[0] if self.last \
                else "a worker failed"
            print(f"ddtrain: {what}; restarting all workers (restart {self.max_restarts - left + 1} of "
                  f"{self.max_restarts})", file=sys.stderr, flush=True)

    def close(self) -> None:
        for lg, (level, propagate) in zip(self.loggers, self.saved):
            lg.removeHandler(self)
            lg.setLevel(level)
            lg.propagate = propagate
        super().close()


def describe_failure(rank: int, exitcode: int, message: str | None = None, shown_above: bool = False) -> str:
    """What happened to a worker, with its own last words (``message``) when it left some."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"worker rank {rank} was killed by {name}; the job was stopped"
    said = f": {_bare(message)}" if message else (" (its message is above)" if shown_above else "")
    return f"worker rank {rank} failed with exit code {exitcode}{said}; the job was stopped"


def _bare(line: str) -> str:
    """A worker's line without its '[rank N] ' and 'ddtrain: error: ' prefixes."""
    return re.sub(r"^(\[rank \d+\] )?(ddtrain: error: )?", "", line.strip())


class WorkerLogs:
    """The workers' stderr, which torchrun writes under ``root``: read as it grows, by a thread.

    Lines the workers print for the user (their notes and warnings) go on to this process's
    stderr as they come; their error lines are kept for the launcher's one line; C++ log records
    stay in the files. A traceback is held back: one that a worker printed and went on from (a
    script's ``traceback.print_exc()``) is passed on when the worker prints its next line, or when
    the job succeeds; one that ended a failed worker is the launcher's one line (the exception and
    the script's line), and the file that holds it is named and kept. The files of a job that did
    not fail are deleted; a failed job's folder is kept (marked, ``processes.keep_folder``) and the
    next launches keep only the newest few (``processes.sweep_folders``).
    """

    CPP_LOG = re.compile(r"^\[[IWEF]\d{4} \d\d:\d\d:\d\d|^Exception raised from |^frame #\d+: |^<omitting python frames>")
    ERROR = ("ddtrain: error:", "stopped: lost contact with another rank", "(the same error at the same place as rank")
    # torch's process group prefixes every line of an uncaught exception's traceback with "[rankN]: "
    TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ?")
    CHAIN = ("During handling", "The above exception")
    FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)')
    # frames of ddtrain, the standard library and installed packages: the script's line is the last other one
    NOT_THE_SCRIPT = ("<frozen ", f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}",
                      os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                      sysconfig.get_paths()["stdlib"] + os.sep)

    def __init__(self):
        from ddtrain.distributed.processes import claim_folder, sweep_folders
        # DDTRAIN_LOG_DIR: where the folder goes (default: the temporary directory)
        parent = os.environ.get("DDTRAIN_LOG_DIR") or tempfile.gettempdir()
        sweep_folders(parent)  # what killed launchers left, and all but the newest failed jobs' logs
        if parent != tempfile.gettempdir():
            sweep_folders(tempfile.gettempdir(), prefixes=("ddtrain-preempt-",))
        self.root = tempfile.mkdtemp(prefix="ddtrain-logs-", dir=parent)
        claim_folder(self.root)
        self.files: dict[str, dict] = {}
        self.errors: dict[tuple[int, int], str] = {}    # (attempt, local rank) -> its first error line
        self.last: dict[tuple[int, int], str] = {}      # (attempt, local rank) -> the end of its traceback
        self.where: dict[tuple[int, int], str] = {}     # (attempt, local rank) -> the script's line in it
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True, name="ddtrain-worker-logs")
        self.thread.start()

    def _follow(self) -> None:
        while not self.done.wait(0.1):
            self.poll()

    def poll(self) -> None:
        with self.lock:
            for path in sorted(glob.glob(os.path.join(self.root, "**", "stderr.log"), recursive=True)):
                self._read(path)

    @staticmethod
    def _key(path: str) -> tuple[int, int]:
        parts = path.split(os.sep)  # <root>/<run id>/attempt_<k>/<local rank>/stderr.log
        try:
            return int(parts[-3].rsplit("_", 1)[-1]), int(parts[-2])
        except (IndexError, ValueError):
            return 0, 0

    def _read(self, path: str, final: bool = False) -> None:
        state = self.files.setdefault(path, {"offset": 0, "partial": "", "traceback": False, "held": []})
        try:
            with open(path, "rb") as f:
                f.seek(state["offset"])
                data = f.read()
        except OSError:
            return
        state["offset"] += len(data)
        *lines, state["partial"] = (state["partial"] + data.decode("utf-8", "replace")).split("\n")
        if final and state["partial"]:
            lines.append(state["partial"])
            state["partial"] = ""
        for line in lines:
            self._line(self._key(path), state, line.rstrip("\r"))

    def _line(self, key, state, line: str) -> None:
        line = self.TORCH_PREFIX.sub("", line)
        held = state["held"]
        if line.startswith("Traceback (most recent call last)"):
            state["traceback"] = True
            held.append(line)
            return
        if state["traceback"]:
            held.append(line)
            if not line.strip() or line[:1].isspace() or line.startswith(self.CHAIN):
                return
            state["traceback"] = False
            self.last[key] = line  # the exception itself
            frames = [m for m in map(self.FRAME.match, held) if m and not any(
                mark in m.group(1) for mark in self.NOT_THE_SCRIPT)]
            if frames:
                self.where[key] = f"{frames[-1].group(1)}, line {frames[-1].group(2)}"
            return
        if held and (not line.strip() or line.startswith(self.CHAIN)):
            held.append(line)   # between the tracebacks of a chained exception
            return
        if self.CPP_LOG.search(line):
            return
        if held:   # the worker went on after its traceback: it was handled, and is the script's to show
            self._show_held(state)
            self.last.pop(key, None)   # shown, and not what ended the worker
            self.where.pop(key, None)
        if any(mark in line for mark in self.ERROR):
            self.errors.setdefault(key, line)
            return
        if not line.strip():
            return
        print(line, file=sys.stderr, flush=True)

    @staticmethod
    def _show_held(state) -> None:
        held = state["held"]
        while held and not held[-1].strip():
            held.pop()
        if held:
            print("\n".join(held), file=sys.stderr, flush=True)
        state["held"] = []

    def message(self, local_rank: int) -> tuple[str | None, str | None]:
        """(the error line, the log file) of ``local_rank`` in the newest attempt it has a log in.

        A traceback's end comes with the script's line that raised it: ``ValueError: x (at job.py, line 5)``.
        """
        self.poll()
        with self.lock:
            attempts = [a for a, r in (self._key(p) for p in self.files) if r == local_rank]
            if not attempts:
                return None, None
            key = (max(attempts), local_rank)
            path = next(p for p in self.files if self._key(p) == key)
            if key in self.errors:
                return self.errors[key], path
            if key in self.last:
                return self.last[key] + (f" (at {self.where[key]})" if key in self.where else ""), path
            return None, path

    def close(self, keep: bool, show_held: bool = False) -> None:
        """Stop following (after a last read); the files go unless ``keep``.

        ``show_held``: the job succeeded, so a traceback a worker printed last was handled (it exited 0): pass it on.
        """
        from ddtrain.distributed.processes import keep_folder
        self.done.set()
        self.thread.join(timeout=5)
        with self.lock:
            for path in list(self.files):
                self._read(path, final=True)
                if show_held:
                    self._show_held(self.files[path])
        if keep:
            keep_folder(self.root)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


def _torchrun_parser():
    """torchrun's own parser, told not to read our flags as abbreviations of its own.

    Otherwise a worker flag such as ``--monitor`` would be taken for torchrun's
    ``--monitor-interval`` before it reaches the worker.
    """
    from torch.distributed.run import get_args_parser
    parser = get_args_parser()
    parser.allow_abbrev = False
    return parser
