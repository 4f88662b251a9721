"""Issue 32's hostile cases of launching and processes (round 3), for tools/hostile_cases.py's table.

    python3 tools/hostile_r3_launch.py [--only SUBSTRING]     # runs them here, with the process and folder checks

``cases()`` gives the rows (``hostile_cases.Case``). Each case's scripts and temporary directory live in
the scratch folder T (``TMPDIR={T}/tmp``), so that ``leftovers(T)`` finds what a case left: a process whose
command line or environment names T (a worker, a script's ``sleep 300``: an orphan) and a ``ddtrain-logs-*``
folder that no line of the output names (a leak). Signal cases send their signals from ``during``; their
expect is ``stopped``: an exit by the signal (128 + N, 75 after a checkpoint, or killed) with the phrase
in ``look_for`` and no traceback.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from hostile_cases import DIGITS, Case, descendants, run_case

P = "tests/integration/test_launch_processes.py::"
D = "tests/distributed/test_launch.py::"
TMP_ENV = {"TMPDIR": "{T}/tmp"}

SCRIPTS = {
    "sleeper.py": """
        import os, signal, subprocess, sys, time
        if "--ignore" in sys.argv:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        import ddtrain
        ddtrain.init()
        subprocess.Popen(["sleep", "300"])
        open(os.path.join(os.path.dirname(__file__), f"ready-{ddtrain.rank()}"), "w").close()
        if "--fail" in sys.argv and ddtrain.rank() == 1:
            time.sleep(1)
            sys.exit(3)
        time.sleep(300)
    """,
    "loop.py": """
        import os, time, torch, ddtrain
        import torch.distributed as dist
        ddtrain.init()
        open(os.path.join(os.path.dirname(__file__), f"ready-{ddtrain.rank()}"), "w").close()
        while True:
            dist.all_reduce(torch.ones(1000))
            time.sleep(0.01)
    """,
    "raises.py": """
        import torch, ddtrain
        import torch.distributed as dist
        ddtrain.init()
        if ddtrain.rank() == 1:
            raise ValueError("bad value on rank one")
        dist.all_reduce(torch.ones(3))
    """,
    "handled.py": """
        import traceback
        import ddtrain
        ddtrain.init()
        if ddtrain.rank() == 0:
            try:
                {}["missing-key"]
            except KeyError:
                traceback.print_exc()
                print("could not read the settings, see traceback above")
        ddtrain.shutdown()
    """,
}


def scripts(T: Path, name: str) -> Path:
    """T/<name>/ holding the scripts and an empty temporary directory: a case's own folder."""
    folder = T / name
    folder.mkdir(exist_ok=True)
    (T / "tmp").mkdir(exist_ok=True)
    for file, body in SCRIPTS.items():
        (folder / file).write_text(textwrap.dedent(body))
    return folder


def _wait(predicate, limit_s: float, proc) -> bool:
    end = time.time() + limit_s
    while time.time() < end and proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def when_ready(signals, gap_s=0.3, group=True, settle_s=1.0):
    """``during``: once both ranks wrote their ready file, send ``signals`` (to the group: a terminal's Ctrl-C)."""
    def during(proc, folder):
        if not _wait(lambda: all((folder / f"ready-{r}").exists() for r in (0, 1)), 240, proc):
            return
        time.sleep(settle_s)
        for sig in signals:
            try:
                (os.killpg if group else os.kill)(proc.pid, sig)
            except ProcessLookupError:
                return
            time.sleep(gap_s)
    return during


def kill_9_as_workers_start(proc, folder) -> None:
    """``during``: SIGKILL the launcher as soon as its two workers exist (they are still importing torch)."""
    if _wait(lambda: len(descendants(proc.pid)) >= 2, 240, proc):
        os.kill(proc.pid, signal.SIGKILL)


def after_seconds(seconds, sig):
    def during(proc, folder):
        time.sleep(seconds)
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
    return during


def when_checkpoint(folder_name, sig):
    def during(proc, T):
        if _wait(lambda: any((T / folder_name).glob("ckpt-*.pt")), 240, proc):
            os.killpg(proc.pid, sig)
    return during


def leftovers(T: Path, output: str = "") -> tuple[list[int], list[str]]:
    """(running processes naming T in their command line or environment, log folders in T/tmp no line names)."""
    procs = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            text = open(f"/proc/{entry}/cmdline", "rb").read() + open(f"/proc/{entry}/environ", "rb").read()
        except (OSError, IndexError):
            continue
        if str(T).encode() in text:
            procs.append(int(entry))
    tmp = T / "tmp"
    if tmp.is_dir():   # what the next launch removes (a killed launcher's folder) is bounded, not leaked
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
        from ddtrain.distributed.processes import sweep_folders
        sweep_folders(str(tmp))
    # a failed job's folder named in its message is kept on purpose (the newest 10, 7 days: sweep_folders); the
    # cases share T/tmp, so an earlier case's kept folder is no leak of a later one
    folders = [str(p) for p in tmp.glob("ddtrain-*") if not (p / ".ddtrain-kept").exists()] if tmp.is_dir() else []
    return procs, [f for f in folders if f not in output]


def cases() -> list[Case]:
    out: list[Case] = []
    run = ["run", "--nproc", "2"]

    def case(group, what, args, expect, test, before, **kw):
        out.append(Case(group, what, args, expect, test, env={**TMP_ENV, **kw.pop("env", {})}, before=before, **kw))

    case("orphans", "kill -9 of the ddtrain run launcher while its 2 workers start (was: both alive 90 s later)",
         [*run, "{T}/k9/sleeper.py"], "stopped", P + "test_kill_9_of_the_ddtrain_run_launcher_while_its_workers_start"
         "_leaves_none", lambda T: scripts(T, "k9"), during=kill_9_as_workers_start, limit_s=120)
    case("orphans", "Ctrl-C x3 on workers that ignore SIGINT/SIGTERM, --checkpoint-dir (was: alive 100 s later)",
         [*run, "--checkpoint-dir", "{T}/ign/ck", "{T}/ign/sleeper.py", "--ignore"], "stopped",
         P + "test_ctrl_c_three_times_kills_workers_that_ignore_it_with_one_line", lambda T: scripts(T, "ign"),
         during=when_ready([signal.SIGINT] * 3), look_for="were killed (SIGKILL)", limit_s=120)
    case("orphans", "Ctrl-C x2 on workers that ignore SIGINT/SIGTERM (no checkpoint directory)",
         [*run, "{T}/ign2/sleeper.py", "--ignore"], "stopped",
         P + "test_ctrl_c_three_times_kills_workers_that_ignore_it_with_one_line", lambda T: scripts(T, "ign2"),
         during=when_ready([signal.SIGINT] * 2), look_for="were killed (SIGKILL)", limit_s=120)
    case("orphans", "a failed rank's child process (sleep 300) (was: outlived the job)",
         [*run, "{T}/kid/sleeper.py", "--fail"], "refused", P + "test_a_failed_rank_s_child_process_ends_with_the_job",
         lambda T: scripts(T, "kid"), limit_s=120)
    case("hangs", "--nnodes 2 --node-rank 0, the other node never comes, Ctrl-C after 6 s (was: ignored 60 s)",
         [*run, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29593", "{T}/rdzv/sleeper.py"],
         "stopped", P + "test_ctrl_c_while_a_multi_node_launch_waits_for_its_other_node_stops_it_at_once",
         lambda T: scripts(T, "rdzv"), during=after_seconds(6, signal.SIGINT), look_for="waiting for the other nodes",
         limit_s=40)
    case("data loss", "a script's handled traceback.print_exc(), exit 0 (was: dropped with its log folder)",
         [*run, "{T}/hand/handled.py"], "ok", P + "test_a_handled_traceback_of_the_script_reaches_the_user",
         lambda T: scripts(T, "hand"), look_for="KeyError: 'missing-key'", limit_s=120)
    case("tracebacks", "rank 1 raises ValueError, rank 0 in an all-reduce (was: rank 0's Gloo traceback, 38 lines)",
         [*run, "{T}/raise/raises.py"], "refused",
         P + "test_one_rank_raising_is_one_line_with_its_exception_and_script_line_not_the_others_gloo_error",
         lambda T: scripts(T, "raise"), look_for="ValueError: bad value on rank one (at ", limit_s=120)
    case("tracebacks", "Ctrl-C of ddtrain run mid all-reduce (was: a Gloo traceback before exit 130)",
         [*run, "{T}/int/loop.py"], "stopped", P + "test_ctrl_c_of_ddtrain_run_is_one_line_without_the_workers_tracebacks",
         lambda T: scripts(T, "int"), during=when_ready([signal.SIGINT]),
         look_for="ddtrain: interrupted (Ctrl-C); the workers were stopped", limit_s=120)
    case("tracebacks", "SIGTERM to the ddtrain run launcher mid all-reduce (was: a Gloo traceback before exit 143)",
         [*run, "{T}/term/loop.py"], "stopped", "tests/integration/test_launch_signals.py::test_sigterm_stops_the_job_"
         "with_one_line_and_exit_143", lambda T: scripts(T, "term"), during=when_ready([signal.SIGTERM], group=False),
         look_for="ddtrain: stopped by SIGTERM; the workers were stopped", limit_s=120)
    case("leaks", "SIGUSR1 to the ddtrain run launcher (was: killed it, its log folder left in $TMPDIR)",
         [*run, "{T}/usr1/loop.py"], "stopped", D + "test_leftover_folders_are_swept_and_failed_jobs_logs_bounded",
         lambda T: scripts(T, "usr1"), during=when_ready([signal.SIGUSR1], group=False),
         look_for="ddtrain: stopped by SIGUSR1", limit_s=120)
    case("leaks", "a failed job's log folder: kept only as named in its message, the newest 10 at most",
         [*run, "{T}/fail/sleeper.py", "--fail"], "refused", D + "test_leftover_folders_are_swept_and_failed_jobs_logs"
         "_bounded", lambda T: scripts(T, "fail"), look_for="full output: ", limit_s=120)
    case("newcomer", "a finished ddtrain train run names its outputs (was: nothing said)",
         [*DIGITS, "--epochs", "1", "--batch-size", "64", "--out", "{T}/done/run.json", "--save", "{T}/done/m.pt"],
         "ok", "tests/cli/test_train_outputs.py::test_a_finished_run_names_its_outputs", lambda T: scripts(T, "done"),
         look_for="ddtrain: done; outputs: results record", limit_s=180)
    case("newcomer", "Ctrl-C of ddtrain train --checkpoint-dir mid-run says the exact command to resume",
         [*DIGITS, "--epochs", "3", "--batch-size", "16", "--checkpoint-dir", "{T}/ctrlc/ck", "--checkpoint-every", "5"],
         "stopped", "tests/cli/test_train_outputs.py::test_the_resume_command_is_the_same_command_with_resume",
         lambda T: scripts(T, "ctrlc"), during=when_checkpoint("ctrlc/ck", signal.SIGINT),
         look_for="to continue from there: ddtrain train", limit_s=180)
    # ``before`` returns the case's folder; ``during`` of the checkpoint case wants T itself
    out[-1].before = lambda T: (scripts(T, "ctrlc"), T)[1]
    for c in out:   # in hostile_cases' table too: ``stopped`` and the leftovers judged here
        c.judge = _judge
    return out


def _judge(row: dict, case: Case, T: Path, output: str) -> dict:
    time.sleep(2)   # a worker killed by its parent's death needs a moment to go
    return verdict(row, case, T, output)


def verdict(row: dict, case: Case, T: Path, output: str) -> dict:
    """hostile_cases' verdict, with ``stopped`` judged here, then an orphan or a leak overriding it."""
    if case.group == "data loss" and row["verdict"] == "traceback" and row["exit"] == 0 and case.look_for in output:
        row["verdict"] = "ok"   # the script's own handled traceback, printed by it: what must reach the user
    if case.expect == "stopped" and row["verdict"] not in ("hang", "traceback"):
        by_signal = row["exit"] is not None and (row["exit"] < 0 or row["exit"] > 128 or row["exit"] == 75)
        row["verdict"] = "ok" if by_signal and (not case.look_for or case.look_for in output) else "unexpected"
    if case.expect in ("ok", "refused") and case.look_for and row["verdict"] == "ok" and case.look_for not in output:
        row["verdict"] = "unexpected"
    procs, folders = leftovers(T, output)
    if procs:
        row["verdict"], row["orphans"] = "orphan", len(procs)
        for pid in procs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    elif folders:
        row["verdict"], row["leaked"] = "leak", [f.replace(str(T), "T") for f in folders]
    return row


def run(case: Case, i: int) -> dict:
    T = Path(tempfile.mkdtemp(prefix="ddtrain-hostile-r3-"))
    try:
        return run_case(i, case, T)   # judged by _judge, inside
    finally:
        import shutil
        shutil.rmtree(T, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    rows = []
    for i, case in enumerate(cases(), 1):
        if args.only and args.only not in case.what and args.only != case.group:
            continue
        row = run(case, i)
        rows.append(row)
        print(f"{i:>3} {row['verdict']:<10} {row['exit']!s:>4} {row['seconds']:>6.1f}s {case.what[:60]}: "
              f"{row['shown'][:100]}", flush=True)
    bad = [r for r in rows if r["verdict"] != "ok"]
    print(f"# {len(rows)} cases, {len(bad)} not ok", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
