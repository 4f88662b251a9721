"""Rendezvous failures end within the deadline on every rank, each naming the cause (issue 22):
a MASTER_PORT held by another program, peers that never come, RANK/WORLD_SIZE left in the
shell by an earlier job, a deadline too short to meet in. Ranks are started as a launcher
would start them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or by ``--nproc``."""
import os
import socket
import subprocess
import sys
import time

import pytest

from helpers import assert_one_clear_error

TRAIN = ["train", "--model", "mlp", "--data", "digits", "--steps", "3", "--batch-size", "32", "--quiet"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank(rank, world, port, *args, extra_env=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "DDTRAIN_LAUNCHER"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **(extra_env or {}))
    return subprocess.Popen([sys.executable, "-m", "ddtrain", *TRAIN, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def finish(proc, limit):
    """(result, seconds) of a started rank; the test fails if it runs past ``limit``."""
    start = time.monotonic()
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still waiting after {limit} s (stderr so far: {err!r})") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - start


@pytest.mark.slow  # 12 s here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_a_master_port_held_by_another_program_is_named_on_every_rank_within_the_deadline():
    # today: rank 0 fails in 2 s, rank 1 talks to the other program and waits 400 s
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(8)  # accepts connections (the kernel does), never answers
    port = holder.getsockname()[1]
    try:
        ranks = [start_rank(r, 2, port, "--timeout", "60") for r in range(2)]
        (r0, _), (r1, _t1) = finish(ranks[0], 90), finish(ranks[1], 90)
    finally:
        holder.close()
    assert_one_clear_error(r0, f"[rank 0] ddtrain: error: rank 0 cannot host the rendezvous on 127.0.0.1:{port} "
                           f"(MASTER_ADDR:MASTER_PORT): "
                               f"the port is in use by another program; set MASTER_PORT to a free port")
    assert_one_clear_error(r1, f"[rank 1] ddtrain: error: the program listening on 127.0.0.1:{port} "
                           f"(MASTER_ADDR:MASTER_PORT) is not "
                               f"rank 0's rendezvous store", "MASTER_PORT is held by another program")
    assert "frame #" not in r0.stderr + r1.stderr


def test_ranks_that_never_come_are_named_at_the_deadline():
    # rank 0 of 3 alone: today "DistStoreError: Timed out ... 1/3 clients joined", no rank named
    port = free_port()
    result, took = finish(start_rank(0, 3, port, "--timeout", "3"), 60)
    assert_one_clear_error(result, f"[rank 0] ddtrain: error: ranks 1, 2 of 3 never joined the rendezvous on 127.0.0.1:{port} "
                                   f"(MASTER_ADDR:MASTER_PORT) within the 3 s deadline (--timeout, DDTRAIN_TIMEOUT_S)",
                           "RANK=0 and WORLD_SIZE=3 come from the environment, not from torchrun")
    assert "frame #" not in result.stderr


def test_a_rank_whose_rank_0_never_comes_says_so_at_the_deadline():
    port = free_port()
    result, _ = finish(start_rank(1, 2, port, "--timeout", "3"), 60)
    assert_one_clear_error(result, f"[rank 1] ddtrain: error: no rendezvous on 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) within "
                                   f"the 3 s deadline (--timeout, DDTRAIN_TIMEOUT_S): rank 0 never opened it")
    assert "frame #" not in result.stderr and "socket.cpp" not in result.stderr


def test_stale_rank_variables_in_the_shell_do_not_take_over_nproc():
    # today: --nproc ignored, this process waits as rank 0 of 2 for a rank 1 nobody starts
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "ddtrain", *TRAIN, "--nproc", "2", "--timeout", "20"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[0] == (
        "ddtrain: warning: ignoring RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 from the environment: no launcher started "
        "this process (no TORCHELASTIC_RUN_ID), and --nproc starts the workers"), result.stderr


def test_a_deadline_too_short_to_meet_is_one_line_without_cpp_frames(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDTRAIN_LOG_DIR": str(tmp_path)}
    env.pop("RANK", None)
    result = subprocess.run([sys.executable, "-m", "ddtrain", *TRAIN, "--nproc", "2", "--timeout", "0.000001"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert_one_clear_error(result, "within the 1e-06 s deadline (--timeout, DDTRAIN_TIMEOUT_S)")
    assert "frame #" not in result.stderr and "[c10d]" not in result.stderr
