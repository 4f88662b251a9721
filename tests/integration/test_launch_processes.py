"""Issue 32: nothing a launch started outlives it, and what a script's ranks said reaches the user.

Real ``ddtrain run --nproc 2`` launches on 127.0.0.1 of tiny scripts: ``kill -9`` of the launcher while
its workers start; Ctrl-C three times on workers that ignore SIGINT and SIGTERM; a failed rank's child
process; Ctrl-C while a multi-node launch waits for a node that never comes; one rank raising; a script's
handled ``traceback.print_exc()``. Every test ends every process it started (``job_tree``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddtrain.distributed.launch import free_port


def env(tmp_path, **extra):
    out = {**os.environ, "OMP_NUM_THREADS": "1", "DDTRAIN_LOG_DIR": str(tmp_path), **extra}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DDTRAIN_FAULT"):
        out.pop(name, None)
    return out


def script(tmp_path, body: str, name="job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def start(tmp_path, *args, **extra):
    # A session of its own, as a shell gives a foreground job: os.killpg(job.pid, SIGINT) is a terminal's Ctrl-C.
    return subprocess.Popen([sys.executable, "-m", "ddtrain", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(tmp_path, **extra), start_new_session=True)


def table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                out[int(entry)] = (int(fields[1]), fields[0])
            except (OSError, IndexError, ValueError):
                pass
    return out


def descendants(root: int) -> list[int]:
    procs, found, frontier = table(), [], [root]
    while frontier:
        frontier = [pid for pid, (parent, _) in procs.items() if parent in frontier]
        found += frontier
    return found


def marked(tmp_path) -> list[int]:
    """Running processes whose command line names this test's folder (the workers, their scripts' children)."""
    out = []
    for pid, (_, state) in table().items():
        if pid == os.getpid() or state == "Z":
            continue
        try:
            if str(tmp_path).encode() in Path(f"/proc/{pid}/cmdline").read_bytes() + \
                    Path(f"/proc/{pid}/environ").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out


def wait_for(predicate, limit, what):
    end = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < end, what
        time.sleep(0.05)


class job_tree:
    """Kills whatever of the test's processes is left, whatever the test's outcome (the launcher is reaped last)."""

    def __init__(self, tmp_path, job):
        self.tmp_path, self.job = tmp_path, job

    def __enter__(self):
        return self.job

    def __exit__(self, *exc):
        for pid in [*descendants(self.job.pid), *marked(self.tmp_path)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.job.poll() is None:
            self.job.kill()
        self.job.communicate()


SLEEPER = """
    import os, signal, subprocess, sys, time
    if "--ignore" in sys.argv:  # a script that ignores the stop signals
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import ddtrain
    ddtrain.init()
    child = subprocess.Popen(["sleep", "300"], env={**os.environ, "TEST_FOLDER": os.path.dirname(__file__)})
    os.write(1, f"ready {ddtrain.rank()} {child.pid}\\n".encode())
    if "--fail" in sys.argv and ddtrain.rank() == 1:
        sys.exit(3)
    time.sleep(300)
"""


def ready(job, n=2) -> list[int]:
    """The children the ranks started, once both said ready."""
    kids = []
    for line in job.stdout:
        if line.startswith("ready"):
            kids.append(int(line.split()[2]))
            if len(kids) == n:
                return kids
    raise AssertionError("the job ended before its ranks were ready: " + job.stderr.read())


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow   # a 2-worker launch killed while its workers start: about 10 s here
def test_kill_9_of_the_ddtrain_run_launcher_while_its_workers_start_leaves_none(tmp_path):
    """Was: both workers still running 90 s later. A launcher killed before its workers reached the parent-death
    tie, and not yet reaped by its own parent (a zombie answers os.kill(pid, 0)), looked alive to them."""
    job = start(tmp_path, "--nproc", "2", script(tmp_path, SLEEPER))
    with job_tree(tmp_path, job):
        wait_for(lambda: len(descendants(job.pid)) >= 2 or job.poll() is not None, 120, "no workers started")
        workers = descendants(job.pid)
        os.kill(job.pid, signal.SIGKILL)   # not reaped: the launcher stays a zombie while the workers start
        wait_for(lambda: not any(running(w) for w in workers), 60, f"workers {workers} outlived their launcher")


@pytest.mark.slow   # a 2-worker launch: about 10 s here
def test_ctrl_c_three_times_kills_workers_that_ignore_it_with_one_line(tmp_path):
    """Was: with --checkpoint-dir both workers ignoring SIGINT/SIGTERM were alive 100 s later (the third Ctrl-C
    restarted the 120 s grace). Now the third kills them (SIGKILL) at once, and one line says so."""
    job = start(tmp_path, "--nproc", "2", "--checkpoint-dir", str(tmp_path / "ck"), script(tmp_path, SLEEPER),
                "--ignore")
    with job_tree(tmp_path, job):
        kids = ready(job)
        workers = descendants(job.pid)
        for _ in range(3):
            os.killpg(job.pid, signal.SIGINT)
            time.sleep(0.3)
        job.wait(timeout=30)
        err = job.stderr.read()
        assert job.returncode == 130, err
        assert err.strip().splitlines() == ["ddtrain: interrupted (Ctrl-C); the workers had not stopped by the third "
                                            "signal and were killed (SIGKILL)"], err
        assert not any(running(p) for p in [*workers, *kids])


@pytest.mark.slow   # a 2-worker launch: about 10 s here
def test_a_failed_rank_s_child_process_ends_with_the_job(tmp_path):
    """Was: a script's subprocess.Popen(['sleep', '300']) outlived its failed rank (and the job)."""
    job = start(tmp_path, "--nproc", "2", script(tmp_path, SLEEPER), "--fail")
    with job_tree(tmp_path, job):
        kids = ready(job)
        job.wait(timeout=120)
        assert job.returncode == 3, job.stderr.read()
        assert not any(running(k) for k in kids), "the ranks' children outlived the job"


@pytest.mark.slow   # about 5 s here
def test_ctrl_c_while_a_multi_node_launch_waits_for_its_other_node_stops_it_at_once(tmp_path):
    """Was: ignored for 60 s (more: the launcher sat in torch's C++ store until its timeout)."""
    job = start(tmp_path, "--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                f"127.0.0.1:{free_port()}", script(tmp_path, SLEEPER))
    with job_tree(tmp_path, job):
        time.sleep(6)   # the launcher is waiting for node 1
        assert job.poll() is None, job.stderr.read()
        os.killpg(job.pid, signal.SIGINT)
        job.wait(timeout=20)
        err = job.stderr.read()
        assert job.returncode == 130, err
        assert len(err.strip().splitlines()) == 1 and "waiting for the other nodes" in err and "Ctrl-C" in err, err
    assert not list(tmp_path.glob("ddtrain-logs-*"))   # an interrupted launch leaves no log folder


RAISES = """
    import torch, ddtrain
    import torch.distributed as dist
    ddtrain.init()
    if ddtrain.rank() == 1:
        raise ValueError("bad value on rank one")
    dist.all_reduce(torch.ones(3))
"""


@pytest.mark.slow   # a 2-worker launch: about 8 s here
def test_one_rank_raising_is_one_line_with_its_exception_and_script_line_not_the_others_gloo_error(tmp_path):
    """Was: rank 0's Gloo traceback and 38 lines, without the user's exception text."""
    path = script(tmp_path, RAISES)
    result = subprocess.run([sys.executable, "-m", "ddtrain", "run", "--nproc", "2", path], capture_output=True,
                            text=True, timeout=180, env=env(tmp_path))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"ddtrain: error: worker rank 1 failed with exit code 1: ValueError: bad value on rank "
                               f"one (at {path}, line 6); the job was stopped (rank 1's full output: "), lines[0]
    assert "Gloo" not in result.stderr and "Connection closed" not in result.stderr


HANDLED = """
    import os, sys, traceback
    import ddtrain
    ddtrain.init()
    if ddtrain.rank() == 0:
        try:
            {}["missing-key"]
        except KeyError:
            traceback.print_exc()
            if "--then-print" in sys.argv:
                print("could not read the settings, see traceback above", file=sys.stderr)
    ddtrain.shutdown()
    sys.exit(1 if "--then-fail" in sys.argv and ddtrain.rank() == 0 else 0)
"""


@pytest.mark.slow   # two 2-worker launches: about 15 s here
def test_a_handled_traceback_of_the_script_reaches_the_user(tmp_path):
    """Was dropped: the log folder deleted after exit 0, "see traceback above" with none above."""
    path = script(tmp_path, HANDLED)
    run = lambda *a: subprocess.run([sys.executable, "-m", "ddtrain", "run", "--nproc", "2", path, *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=180, env=env(tmp_path))
    done = run()
    assert done.returncode == 0, done.stderr
    assert "Traceback (most recent call last)" in done.stderr and "KeyError: 'missing-key'" in done.stderr
    failed = run("--then-print", "--then-fail")
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode == 1 and lines[0] == "Traceback (most recent call last):", failed.stderr
    assert lines[-2] == "could not read the settings, see traceback above", failed.stderr
    assert lines[-1].startswith("ddtrain: error: worker rank 0 failed with exit code 1; the job was stopped "
                                "(rank 0's full output: "), failed.stderr
    assert Path(lines[-1].rsplit(": ", 1)[1].rstrip(")")).exists()   # the folder named is kept


LOOP = """
    import os, time, torch, ddtrain
    import torch.distributed as dist
    ddtrain.init()
    os.write(1, b"ready 0 0\\n")
    while True:
        dist.all_reduce(torch.ones(1000))
        time.sleep(0.01)
"""


@pytest.mark.slow   # a 2-worker launch: about 8 s here
def test_ctrl_c_of_ddtrain_run_is_one_line_without_the_workers_tracebacks(tmp_path):
    """Was: rank 0's KeyboardInterrupt and Gloo tracebacks ("[rank0]: Traceback ...") before the exit 130."""
    job = start(tmp_path, "--nproc", "2", script(tmp_path, LOOP))
    with job_tree(tmp_path, job):
        job.stdout.readline()
        time.sleep(1)
        os.killpg(job.pid, signal.SIGINT)
        job.wait(timeout=60)
        err = job.stderr.read()
        assert job.returncode == 130, err
        assert err.strip().splitlines() == ["ddtrain: interrupted (Ctrl-C); the workers were stopped"], err
