"""One message per failure (issue 22): ``ddtrain train --nproc N`` prints one line naming the rank
that failed first and what it said, with the log file that holds the rest; the environment
variables ddtrain reads are checked before any command runs, ``--help`` included."""
import os
import re
import subprocess
import sys

import pytest

from helpers import assert_one_clear_error

TRAIN = ["train", "--model", "mlp", "--data", "digits", "--epochs", "1", "--batch-size", "32", "--quiet"]


def run(*args, timeout=180, **extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "ddtrain", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.mark.slow  # 10 s here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_a_failed_worker_is_one_line_naming_it_and_its_log_file(tmp_path):
    # today: the worker's line, then the launcher's "worker rank 2 failed ... (its message is above)"
    result = run(*TRAIN, "--nproc", "3", DDTRAIN_FAULT="rank=2,step=3,kind=raise", DDTRAIN_LOG_DIR=str(tmp_path))
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    match = re.fullmatch(r"\[rank 2\] ddtrain: error: InjectedFault: rank 2 deliberately failed at step 3 "
                         r"\(DDTRAIN_FAULT\) .*\(rank 2's full output: (\S+stderr\.log)\)", lines[0])
    assert match, lines[0]
    assert match.group(1).startswith(str(tmp_path / "ddtrain-logs-"))  # DDTRAIN_LOG_DIR says where
    with open(match.group(1)) as log:  # the file named holds what the worker printed
        assert "InjectedFault: rank 2 deliberately failed at step 3" in log.read()


def test_a_killed_worker_is_one_line_naming_the_signal(tmp_path):
    result = run(*TRAIN, "--nproc", "2", DDTRAIN_FAULT="rank=1,step=3,kind=kill", DDTRAIN_LOG_DIR=str(tmp_path))
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ddtrain: error: worker rank 1 was killed by SIGKILL; the job was stopped "
                               "(rank 1's full output: "), lines[0]


BAD_ENV = [
    ("DDTRAIN_FAULT", "rank=1", "environment variable DDTRAIN_FAULT='rank=1': expected rank=R,step=S,kind=K"),
    ("DDTRAIN_FAULT", "rank=1,step=2,kind=boom", "environment variable DDTRAIN_FAULT kind 'boom': valid: raise,"),
    ("DDTRAIN_FAULT", "rank=1,step=2,knd=kill", "unknown key 'knd'"),
    ("DDTRAIN_TIMEOUT_S", "soon", "DDTRAIN_TIMEOUT_S must be a number of seconds, got 'soon'"),
    ("MASTER_PORT", "http", "environment variable MASTER_PORT='http' is not an integer"),
    ("MASTER_PORT", "70000", "environment variable MASTER_PORT='70000' must be from 1 to 65535"),
    ("WORLD_SIZE", "0", "environment variable WORLD_SIZE='0' must be >= 1"),
    ("DDTRAIN_BACKEND", "mpi", "environment variable DDTRAIN_BACKEND='mpi': valid: gloo, nccl"),
    ("DDTRAIN_LOG_DIR", "/nonexistent/logs", "environment variable DDTRAIN_LOG_DIR='/nonexistent/logs' is not a directory"),
]


@pytest.mark.parametrize("name,value,phrase", BAD_ENV, ids=[f"{n}={v}" for n, v, _ in BAD_ENV])
@pytest.mark.parametrize("command", [["--help"], ["train", "--help"], ["report", "nowhere"]], ids=" ".join)
def test_a_bad_environment_variable_is_one_line_for_every_command(command, name, value, phrase):
    # today: DDTRAIN_FAULT gives a traceback (train), or is not looked at (--help, report)
    from ddtrain import cli
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        import io
        from contextlib import redirect_stderr, redirect_stdout
        err, out = io.StringIO(), io.StringIO()
        with redirect_stderr(err), redirect_stdout(out):
            try:
                code = cli.main(command)
            except SystemExit as exc:
                code = exc.code
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
    result = subprocess.CompletedProcess(command, code, out.getvalue(), err.getvalue())
    assert code == 2, (out.getvalue(), err.getvalue())
    assert_one_clear_error(result, phrase)
    assert "usage:" not in out.getvalue()


def test_a_bad_fault_variable_in_a_real_process_is_one_line():
    result = run(*TRAIN, "--nproc", "2", DDTRAIN_FAULT="rank=one,step=3", timeout=60)
    assert result.returncode == 2
    assert_one_clear_error(result, "environment variable DDTRAIN_FAULT='rank=one,step=3': expected rank=R,step=S,kind=K")


def test_a_rank_not_below_the_world_size_is_one_line():
    result = subprocess.run([sys.executable, "-m", "ddtrain", "--help"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "RANK": "3", "WORLD_SIZE": "2"})
    assert result.returncode == 2
    assert_one_clear_error(result, "environment variables RANK=3 and WORLD_SIZE=2: the rank must be below the world size")
