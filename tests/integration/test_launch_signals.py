"""The launcher and its workers live and die together (issue 22): ``kill -9`` of the launcher of a
2-worker run leaves no worker behind, and an immediate ``--resume`` ends bit for bit where an
uninterrupted run ends; Ctrl-C and SIGTERM stop the job with one line and exit 130 and 143."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

COMMON = ["train", "--model", "mlp", "--data", "digits", "--nproc", "2", "--epochs", "2", "--batch-size", "32",
          "--lr", "0.05", "--momentum", "0.9", "--seed", "1", "--quiet"]


def env(**extra):
    out = {**os.environ, "OMP_NUM_THREADS": "1", **extra}  # one thread per rank: bitwise-repeatable sums
    out.pop("RANK", None)
    out.pop("DDTRAIN_FAULT", None) if "DDTRAIN_FAULT" not in extra else None
    return out


def start(*args, **extra):
    # A session of its own, as a shell gives a foreground job: a signal to the group reaches only it.
    return subprocess.Popen([sys.executable, "-m", "ddtrain", *COMMON, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env(**extra), start_new_session=True)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may be slow to reap what it inherits)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate, limit, what):
    end = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < end, what
        time.sleep(0.05)


@pytest.mark.slow  # three 2-worker runs: about 40 s here
def test_kill_9_of_the_launcher_leaves_no_worker_and_a_resume_equals_an_uninterrupted_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    # Rank 1 stops inside step 40 (rank 0 waits for it in the all-reduce): the launcher is killed mid-run,
    # deterministically after the checkpoint of step 30 (23 steps an epoch).
    job = start("--checkpoint-dir", str(ckpt), "--checkpoint-every", "10", "--save", str(tmp_path / "x.pt"),
                DDTRAIN_FAULT="rank=1,step=40,kind=hang")
    workers = []
    try:
        wait_for(lambda: (ckpt / "ckpt-00000030.pt").exists() or job.poll() is not None, 120, "no checkpoint")
        workers = children(job.pid)
        assert job.poll() is None and len(workers) == 2, (workers, job.poll())
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=10)
        killed = time.monotonic()
        wait_for(lambda: not any(running(w) for w in workers), 5, f"workers {workers} outlived their launcher")
        assert time.monotonic() - killed <= 5
        assert not any(str(ckpt) in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                       for p in os.listdir("/proc") if p.isdigit() and running(int(p)) and int(p) != os.getpid()
                       if Path(f"/proc/{p}/cmdline").exists())
        assert not (tmp_path / "x.pt").exists()
    finally:
        for pid in [job.pid, *workers]:  # on a failure, leave no process of this test behind
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        job.wait()
    resumed = subprocess.run([sys.executable, "-m", "ddtrain", *COMMON, "--checkpoint-dir", str(ckpt), "--resume",
                              "--save", str(tmp_path / "resumed.pt")], capture_output=True, text=True, timeout=300,
                             env=env())
    assert resumed.returncode == 0, resumed.stderr
    plain = subprocess.run([sys.executable, "-m", "ddtrain", *COMMON, "--save", str(tmp_path / "plain.pt")],
                           capture_output=True, text=True, timeout=300, env=env())
    assert plain.returncode == 0, plain.stderr
    a = torch.load(tmp_path / "plain.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit


def stop_with(sig, to_group: bool):
    """A real 2-worker job, stopped by ``sig`` once rank 1 is inside training; (exit status, stderr, workers)."""
    job = start("--timeout", "120", DDTRAIN_FAULT="rank=1,step=3,kind=skip")
    lines = []
    for line in job.stderr:  # forwarded by the launcher as it happens
        lines.append(line)
        if "DDTRAIN_FAULT: skipping" in line:
            break
    workers = children(job.pid)
    (os.killpg if to_group else os.kill)(job.pid, sig)
    try:
        job.wait(timeout=60)
    finally:
        for pid in [job.pid, *workers]:  # on a failure, leave no process of this test behind
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    rest = job.stderr.read()
    return job.returncode, "".join(lines) + rest, workers


def test_ctrl_c_stops_the_job_with_one_line_and_exit_130():
    code, err, workers = stop_with(signal.SIGINT, to_group=True)  # what a terminal's Ctrl-C does
    assert code == 130, err
    assert err.splitlines()[-1] == "ddtrain: interrupted (Ctrl-C); the workers were stopped", err
    assert "error" not in err.lower() and "Traceback" not in err and "death signal" not in err, err
    assert len(workers) == 2 and not any(running(w) for w in workers)


def test_sigterm_stops_the_job_with_one_line_and_exit_143():
    code, err, workers = stop_with(signal.SIGTERM, to_group=False)  # kill PID, as a scheduler does
    assert code == 143, err
    assert err.splitlines()[-1] == "ddtrain: stopped by SIGTERM; the workers were stopped", err
    assert "error" not in err.lower() and "Traceback" not in err and "death signal" not in err, err
    assert len(workers) == 2 and not any(running(w) for w in workers)
