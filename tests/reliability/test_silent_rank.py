"""A stopped rank (SIGSTOP) is named within seconds by its heartbeat watcher while the job keeps
waiting up to --timeout (issue 22: was 300 s of silence before the stall message)."""
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import REPO


@pytest.mark.slow  # a 3-worker job stopped and resumed: about 20 s
def test_a_stopped_rank_is_named_while_the_job_waits():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"), "DDTRAIN_SILENT_S": "3"}
    for name in ("RANK", "WORLD_SIZE", "DDTRAIN_RUN_ID"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "ddtrain", "train", "--model", "mlp", "--data", "digits", "--nproc",
                             "3", "--batch-size", "8", "--epochs", "50", "--timeout", "60", "--log-every", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()

    def wait_for(phrase, within):
        deadline, seen = time.time() + within, []
        while time.time() < deadline:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                continue
            seen.append(line)
            if phrase in line:
                return line, time.time()
        raise AssertionError(f"no {phrase!r} within {within} s: {''.join(seen)}")
    try:
        wait_for("step 10 - loss", 120)
        pids = _worker_pids_of(proc.pid)
        assert sorted(pids) == [0, 1, 2], pids
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.time()
        line, when = wait_for("rank 1 has been silent", 30)
        assert line.startswith("[rank 0] ddtrain: warning: rank 1 has been silent for "), line
        assert "it may be stopped (SIGSTOP, Ctrl-Z, a debugger) or frozen; the job keeps waiting for it up to the " \
               "60 s deadline (--timeout)" in line
        assert when - stopped < 3 + 5, when - stopped   # the threshold, one heartbeat, one watch, margin
        assert proc.poll() is None                       # still waiting, not ended
        os.kill(pids[1], signal.SIGCONT)
        wait_for("[rank 0] ddtrain: note: rank 1 is heard from again after", 15)
        assert proc.poll() is None
    finally:
        workers = _worker_pids_of(proc.pid)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers.values():  # torchrun starts them in sessions of their own: no orphans left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def _worker_pids_of(launcher_pid: int) -> dict:
    """The workers are the launcher's grandchildren or children: find them by their parent chain."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid, chain = int(entry), []
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        ranks = [item[5:] for item in env if item.startswith(b"RANK=")]
        if not ranks or b"ddtrain" not in cmd:
            continue
        parent = pid
        for _ in range(4):  # walk up to the launcher
            try:
                parent = int(open(f"/proc/{parent}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
            chain.append(parent)
        if launcher_pid in chain:
            found[int(ranks[0])] = pid
    return found
