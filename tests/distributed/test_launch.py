"""The launcher's pieces on their own (issue 22): which variables count as stale, how a worker's
stderr is sorted into what the user sees now, what waits for the one failure line and what stays
in the log file; the parent-death tie of a worker."""
import os
import signal
import subprocess
import sys
import textwrap
import time

from ddtrain.distributed import launch


def test_rank_variables_without_torchrun_are_stale():
    assert launch.stale_launch_variables({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "PATH": "/bin"}) == \
        ["RANK", "WORLD_SIZE", "LOCAL_RANK"]
    assert launch.stale_launch_variables({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}) == []
    assert launch.stale_launch_variables({"WORLD_SIZE": "2"}) == []


def test_worker_logs_pass_notes_on_keep_errors_and_hide_cpp_frames(tmp_path, capsys):
    logs = launch.WorkerLogs()
    try:
        rank1 = os.path.join(logs.root, "none_abc", "attempt_0", "1")
        os.makedirs(rank1)
        with open(os.path.join(rank1, "stderr.log"), "w") as f:
            f.write(textwrap.dedent("""\
                [rank 1] DDTRAIN_FAULT: skipping the collectives of step 3 and after
                [W1126 10:54:38.654591359 TCPStore.cpp:340] [c10d] TCP client failed to connect
                Exception raised from throwTimeoutError at socket.cpp:1030 (most recent call first):
                frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f3c in libc10.so)
                <omitting python frames>

                [rank 1] ddtrain: warning: rank 0 has not been heard from for 30 s
                [rank 1] ddtrain: error: InjectedFault: rank 1 deliberately failed at step 3
                [rank 1] ddtrain: error: a second line is not the cause
                """))
        line, path = logs.message(1)
        assert line == "[rank 1] ddtrain: error: InjectedFault: rank 1 deliberately failed at step 3"
        assert path == os.path.join(rank1, "stderr.log")
        assert capsys.readouterr().err.splitlines() == [
            "[rank 1] DDTRAIN_FAULT: skipping the collectives of step 3 and after",
            "[rank 1] ddtrain: warning: rank 0 has not been heard from for 30 s"]
        assert logs.message(0) == (None, None)
    finally:
        logs.close(keep=False)
    assert not os.path.exists(logs.root)


def test_a_traceback_stays_in_the_log_and_its_last_line_names_the_failure(capsys):
    logs = launch.WorkerLogs()
    try:
        rank0 = os.path.join(logs.root, "r", "attempt_2", "0")
        os.makedirs(rank0)
        with open(os.path.join(rank0, "stderr.log"), "w") as f:
            f.write('Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n    import nope\n'
                    "ModuleNotFoundError: No module named 'nope'\n")
        line, _ = logs.message(0)
        assert line == "ModuleNotFoundError: No module named 'nope' (at x.py, line 1)"   # the script's line (issue 32)
        assert capsys.readouterr().err == ""
        assert launch.describe_failure(0, 1, line) == ("worker rank 0 failed with exit code 1: ModuleNotFoundError: "
                                                       "No module named 'nope' (at x.py, line 1); the job was stopped")
    finally:
        logs.close(keep=False)


WORKER = """
import os, sys, time
os.environ["RANK"] = "0"; os.environ["WORLD_SIZE"] = "1"
os.environ["DDTRAIN_LAUNCHER_PID"] = str(os.getppid())
from ddtrain.distributed import launch
launch.die_with_launcher()
print(os.getpid(), flush=True)
time.sleep(60)
"""

LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout)
time.sleep(60)
"""


def gone_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` exits (gone, or a zombie) within ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_worker_dies_with_its_launcher_even_when_the_launcher_is_sigkilled():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(launcher.stdout.readline())
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        if not gone_within(worker, 5):
            os.kill(worker, signal.SIGKILL)
            raise AssertionError("the worker outlived its launcher by 5 s")
    finally:
        if launcher.poll() is None:
            launcher.kill()


# ---- issue 32 ----

SLOW_WORKER = """
import os, sys, time
os.environ["RANK"] = "0"; os.environ["WORLD_SIZE"] = "1"
os.environ["DDTRAIN_LAUNCHER_PID"] = str(os.getppid())
print(os.getpid(), flush=True)
time.sleep(1.5)   # importing torch: the launcher is killed meanwhile
from ddtrain.distributed import launch
launch.die_with_launcher()
time.sleep(60)
"""

SESSION_LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout, start_new_session=True)
time.sleep(60)
"""


def test_a_worker_whose_launcher_died_before_the_tie_exits_though_the_launcher_is_an_unreaped_zombie():
    """Issue 32: kill -9 of ``ddtrain run``'s launcher while its workers imported torch left both running: the
    launcher, not yet reaped by its parent, answered os.kill(pid, 0), so the worker took itself for a process
    started further down. A worker of its own session (torchrun's) whose parent changed exits."""
    launcher = subprocess.Popen([sys.executable, "-c", SESSION_LAUNCHER, SLOW_WORKER], stdout=subprocess.PIPE,
                                text=True)
    worker = int(launcher.stdout.readline())
    try:
        launcher.send_signal(signal.SIGKILL)   # and not reaped until the end: a zombie meanwhile
        if not gone_within(worker, 20):
            raise AssertionError("the worker outlived its launcher by 20 s")
    finally:
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait()


def write_log(logs, rank: int, text: str, attempt: int = 0) -> None:
    folder = os.path.join(logs.root, "r", f"attempt_{attempt}", str(rank))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "stderr.log"), "a") as f:
        f.write(text)


GLOO = ("[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce\n'
        "[rank0]:     work.wait()\n"
        "[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:2691\n")
RAISED = ("[rank1]: Traceback (most recent call last):\n"
          '[rank1]:   File "/home/me/job.py", line 5, in <module>\n'
          '[rank1]:     raise ValueError("bad")\n'
          "[rank1]: ValueError: bad\n")


def test_torch_s_rank_prefixed_tracebacks_are_held_and_the_raising_rank_is_the_cause(capsys):
    """Issue 32: torch's excepthook prefixes "[rankN]: ", so the tracebacks went through to the user line by line
    (38 lines), and rank 0's consequential Gloo error could be named instead of rank 1's own exception."""
    from types import SimpleNamespace
    logs = launch.WorkerLogs()
    try:
        write_log(logs, 0, GLOO)
        write_log(logs, 1, RAISED)
        assert logs.message(1)[0] == "ValueError: bad (at /home/me/job.py, line 5)"
        assert capsys.readouterr().err == ""
        failures = {0: SimpleNamespace(exitcode=1, timestamp=100, local_rank=0),   # seen first, same second
                    1: SimpleNamespace(exitcode=1, timestamp=100, local_rank=1)}
        assert launch.cause(failures, lambda r: logs.message(r)[0])[0] == 1
    finally:
        logs.close(keep=False)


def test_a_handled_traceback_is_passed_on_when_the_worker_goes_on_or_the_job_succeeds(capsys):
    """Issue 32: a script's traceback.print_exc() was dropped (the folder deleted after a job that did not fail)."""
    handled = 'Traceback (most recent call last):\n  File "job.py", line 3, in <module>\nKeyError: \'k\'\n'
    logs = launch.WorkerLogs()
    try:
        write_log(logs, 0, handled + "\nDuring handling of the above exception, another exception occurred:\n\n"
                  + handled + "see the traceback above\n")
        logs.poll()
        assert capsys.readouterr().err.splitlines()[-2:] == ["KeyError: 'k'", "see the traceback above"]
        assert logs.message(0)[0] is None   # shown, not what ended the worker
        write_log(logs, 1, handled)
        logs.poll()
        assert capsys.readouterr().err == ""   # perhaps the end of rank 1: held
    finally:
        logs.close(keep=False, show_held=True)   # the job succeeded: it was handled
    assert capsys.readouterr().err.splitlines()[-1] == "KeyError: 'k'"


def test_leftover_folders_are_swept_and_failed_jobs_logs_bounded(tmp_path):
    """Issue 32: failed jobs' ddtrain-logs-* folders stayed in $TMPDIR forever (and a killed launcher's too)."""
    from ddtrain.distributed import processes
    mine = tmp_path / "ddtrain-logs-running"
    mine.mkdir()
    processes.claim_folder(str(mine))                  # this process runs: never touched
    killed = tmp_path / "ddtrain-logs-killed"
    killed.mkdir()
    (killed / processes.OWNER_FILE).write_text("999999999 1\n")   # a launcher that is gone, nothing named it
    kept = []
    for i in range(processes.KEEP_FAILED + 2):
        folder = tmp_path / f"ddtrain-logs-failed{i:02d}"
        folder.mkdir()
        (folder / processes.OWNER_FILE).write_text("999999999 1\n")
        processes.keep_folder(str(folder))
        os.utime(folder, (1000 + i, 1000 + i))
        kept.append(folder)
    os.utime(kept[-1], None)   # the newest: now
    old = tmp_path / "ddtrain-logs-ownerless"
    old.mkdir()
    os.utime(old, (1, 1))     # an older ddtrain's, days old
    other = tmp_path / "unrelated"
    other.mkdir()
    processes.sweep_folders(str(tmp_path))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["ddtrain-logs-failed11", "ddtrain-logs-running", "unrelated"], left  # the rest is days old


def test_job_processes_are_found_by_token_and_session():
    from ddtrain.distributed import processes
    token = processes.new_token()
    marked = subprocess.Popen(["sleep", "30"], env={**os.environ, processes.TOKEN_ENV: token})
    session = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '30'])"],
                               start_new_session=True, env={"PATH": os.environ.get("PATH", "")})
    try:
        time.sleep(0.5)
        found = processes.job_processes(token, [session.pid])
        assert marked.pid in found and session.pid in found and len(found) == 3, found   # the session's sleep too
        processes.end_job(token, [session.pid], grace_s=1)
        assert marked.wait(timeout=5) is not None and session.wait(timeout=5) is not None
        assert processes.job_processes(token, [session.pid]) == []
    finally:
        for p in (marked, session):
            if p.poll() is None:
                p.kill()
            p.wait()


def _watched(alive, **times):
    """A SignalWatch on this process's SIGTERM (a no-op handler, as torchrun's launcher has one); its stuck calls."""
    from ddtrain.distributed import processes
    stuck = []
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    watch = processes.SignalWatch(kill_after=3, stuck=stuck.append, escalate=lambda *_: None,
                                  workers_alive=lambda: alive[0], **times)
    assert watch.start()
    return watch, stuck, previous


def test_a_launcher_slow_to_return_after_its_workers_saved_and_ended_is_not_called_stuck():
    """Was CI's exit 143 for 75: SIGTERM reached workers that saved and exited within 1.5 s, the loaded launcher
    was still returning, and the watch thread took it for one blocked in C++ before its workers started."""
    alive = [True]
    watch, stuck, previous = _watched(alive, stuck_s=0.5, settle_s=1.5)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        alive[0] = False            # the workers saved and ended within stuck_s; the launcher has not returned yet
        time.sleep(1.0)             # twice stuck_s: the old check had called it stuck by now
        assert stuck == []
        time.sleep(1.5)             # settle_s after the workers ended, still not returned: stuck after all
        assert stuck == [signal.SIGTERM]
    finally:
        watch.close()
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_while_no_worker_runs_is_stuck_after_stuck_s_and_not_when_the_launch_ends_first():
    alive = [False]
    watch, stuck, previous = _watched(alive, stuck_s=0.3, settle_s=60)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)
        assert stuck == [signal.SIGTERM]          # blocked before its workers started: stopped within stuck_s
    finally:
        watch.close()
        signal.signal(signal.SIGTERM, previous)
    watch, stuck, previous = _watched(alive, stuck_s=0.5, settle_s=60)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        watch.close()                             # the launch returned in time
        time.sleep(0.8)
        assert stuck == []
    finally:
        signal.signal(signal.SIGTERM, previous)
