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
        assert line == "ModuleNotFoundError: No module named 'nope'"
        assert capsys.readouterr().err == ""
        assert launch.describe_failure(0, 1, line) == ("worker rank 0 failed with exit code 1: ModuleNotFoundError: "
                                                       "No module named 'nope'; the job was stopped")
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


def test_a_worker_dies_with_its_launcher_even_when_the_launcher_is_sigkilled():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(launcher.stdout.readline())
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        end = time.monotonic() + 5
        while time.monotonic() < end:
            try:
                state = open(f"/proc/{worker}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                break
            if state == "Z":
                break
            time.sleep(0.05)
        else:
            os.kill(worker, signal.SIGKILL)
            raise AssertionError("the worker outlived its launcher by 5 s")
    finally:
        if launcher.poll() is None:
            launcher.kill()
