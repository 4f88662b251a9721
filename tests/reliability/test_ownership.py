"""One run per checkpoint directory (issue 22): a second run is refused naming the owner, a dead
run's lock is taken over, a restart of the same run is let in, every checkpoint names its run, and
--resume continues only the directory's own lineage unless --resume-any says otherwise."""
import json
import os
import shutil
import signal
import subprocess
import sys
import re
import time

import pytest

from helpers import REPO, assert_one_clear_error, ddtrain
from ddtrain.errors import DDTrainError
from ddtrain.reliability import checkpoint, ownership

TRAIN = ["train", "--model", "mlp", "--data", "digits", "--nproc", "2", "--batch-size", "32", "--seed", "1",
         "--quiet", "--model-arg", "hidden=16"]
ONE = [*TRAIN[:6], "1", *TRAIN[7:]]  # one worker where two add nothing to what is tested
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}


def _env(**extra):
    env = {**os.environ, **ENV, **extra}
    for name in ("RANK", "WORLD_SIZE"):
        env.pop(name, None)
    # empty, not absent: helpers.ddtrain merges os.environ back in, and an in-process fit of an
    # earlier test set this process's run id (and launch id); every command here is a run of its own
    env[ownership.RUN_ID_ENV] = ""
    env[ownership.LAUNCH_ID_ENV] = ""
    return env


def _holder(directory, role, run_id, launch_id="", nodes=1):
    """A process of another run (or launch) holding ``directory``'s ``role`` lock until killed."""
    code = (f"import sys, time; from ddtrain.reliability import ownership; "
            f"ownership.claim(sys.argv[1], {role!r}, nodes={nodes}); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(directory)], stdout=subprocess.PIPE, text=True,
                            env={**_env(), ownership.RUN_ID_ENV: run_id, ownership.LAUNCH_ID_ENV: launch_id})
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow  # real training runs (2 workers, a run in progress; 4 runs)
def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_owner(tmp_path):
    """Was: both runs accepted, overwriting each other's checkpoints (both exit 0)."""
    ck = tmp_path / "ck"
    first = subprocess.Popen([sys.executable, "-m", "ddtrain", *TRAIN, "--epochs", "1", "--checkpoint-dir", str(ck),
                              "--checkpoint-every", "4", "--timeout", "120"], env=_env(DDTRAIN_FAULT="rank=0,step=9,kind=hang"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 90
        while not (ck / "ckpt-00000008.pt").exists():
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.2)
        second = ddtrain(*TRAIN, "--epochs", "1", "--checkpoint-dir", str(ck), "--resume", env=_env())
        assert_one_clear_error(second, f"--checkpoint-dir {ck} is in use by run ", f"pid {first.pid} on host ",
                               "its launching process", "ddtrain train --model mlp")
        assert second.returncode == 2
        assert sorted(p.name for _, p in checkpoint.listing(ck)) == ["ckpt-00000004.pt", "ckpt-00000008.pt"]
    finally:
        workers = _children(first.pid)
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        for pid in workers:  # torchrun starts them in sessions of their own: no orphans left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        first.wait()


def _children(root: int) -> list[int]:
    """Every process below ``root`` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = [], [root]
    while frontier:
        kids = [pid for pid, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def test_a_live_rank0_worker_of_another_run_blocks_the_directory(tmp_path):
    """An orphaned worker still writing (its launcher gone) holds the directory: a resume must not race it."""
    ck = tmp_path / "ck"
    holder = _holder(ck, "rank0", "orphan-run")
    try:
        result = ddtrain(*ONE, "--epochs", "1", "--checkpoint-dir", str(ck), env=_env())
        assert_one_clear_error(result, "is in use by run orphan-run (its rank 0 worker", f"pid {holder.pid}",
                               f"kill {holder.pid}")
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_dead_run_is_taken_over(tmp_path):
    ck = tmp_path / "ck"
    holder = _holder(ck, "launcher", "crashed-run")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    result = ddtrain(*ONE, "--epochs", "1", "--steps", "6", "--checkpoint-dir", str(ck), env=_env())
    assert result.returncode == 0, result.stderr
    assert "was held by run crashed-run" in result.stderr and "takes it over" in result.stderr
    assert "Traceback" not in result.stderr
    owner = json.loads((ck / ownership.LOCKS["launcher"]).read_text())
    assert owner["run_id"] != "crashed-run" and owner["released"]


def test_a_released_lock_is_free_and_not_reported_as_a_crashed_runs(tmp_path, monkeypatch):
    """A run that ended and released its lock left a record marked released: the next run takes the directory without
    the "ended without releasing it; taken over" note meant for a crashed run's lock (tested above)."""
    monkeypatch.setenv(ownership.RUN_ID_ENV, "finished-run")
    assert ownership.claim(tmp_path, "rank0") is None
    ownership.release(tmp_path, "rank0")
    assert json.loads((tmp_path / ownership.LOCKS["rank0"]).read_text())["released"]
    monkeypatch.setenv(ownership.RUN_ID_ENV, "next-run")
    try:
        assert ownership.claim(tmp_path, "rank0") is None
    finally:
        ownership.release(tmp_path, "rank0")


@pytest.mark.slow  # real training runs (2 workers, a run in progress; 4 runs)
def test_every_checkpoint_names_its_run_and_a_foreign_lineage_needs_resume_any(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        result = ddtrain(*ONE, "--epochs", "1", "--steps", "8", "--checkpoint-dir", str(folder),
                         "--checkpoint-every", "4", env=_env())
        assert result.returncode == 0, result.stderr
    lineage_a = ownership.lineage(a)["lineage"]
    for _, path in checkpoint.listing(a):
        run = checkpoint.read_header(path)[0]["run"]
        assert run["lineage"] == lineage_a and run["run_id"] == lineage_a
    assert ownership.lineage(b)["lineage"] != lineage_a
    # b's newest checkpoint lands in a (a copy, a sync tool, a run before locks existed)
    shutil.copy(b / "ckpt-00000008.pt", a / "ckpt-00000012.pt")
    result = ddtrain(*ONE, "--epochs", "1", "--steps", "16", "--checkpoint-dir", str(a), "--resume", env=_env())
    assert_one_clear_error(result, f"--resume finds {a / 'ckpt-00000012.pt'} written by another run",
                           f"not by this directory's run (lineage {lineage_a})", "--resume-any")
    result = ddtrain(*ONE, "--epochs", "1", "--steps", "16", "--checkpoint-dir", str(a), "--resume",
                     "--resume-any", env=_env())
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout and "ckpt-00000012.pt at step 8" in result.stdout
    assert ownership.lineage(a)["lineage"] == ownership.lineage(b)["lineage"]


def test_resume_any_needs_resume():
    result = ddtrain(*ONE, "--checkpoint-dir", "x", "--resume-any", env=_env())
    assert_one_clear_error(result, "--resume-any needs --resume")


CLAIM = "import sys; from ddtrain.reliability import ownership; print(ownership.claim(sys.argv[1], sys.argv[2]))"


def _claim(directory, role, run_id, launch_id="", nodes=1):
    code = CLAIM.replace("sys.argv[2])", f"sys.argv[2], nodes={nodes})")
    return subprocess.run([sys.executable, "-c", code, str(directory), role], capture_output=True, text=True,
                          env={**_env(), ownership.RUN_ID_ENV: run_id, ownership.LAUNCH_ID_ENV: launch_id}, timeout=60)


def test_processes_of_one_run_share_the_lock(tmp_path):
    """A torchrun restart is the same run and launch (it inherits both ids): its rank 0 may take the lock its
    launcher holds; another run may not."""
    ck = tmp_path / "ck"
    holder = _holder(ck, "launcher", "same-run", "launch-1")
    try:
        ok = _claim(ck, "rank0", "same-run", "launch-1")
        assert ok.returncode == 0 and ok.stdout.strip() == "None", ok.stderr
        other = _claim(ck, "rank0", "other-run")
        assert other.returncode != 0 and "is in use by run same-run" in other.stderr
    finally:
        holder.kill()
        holder.wait()


def test_two_launches_that_share_an_exported_run_id_are_two_runs(tmp_path):
    """Was: a sweep script exported DDTRAIN_RUN_ID, so a second --resume on a directory in use was let in (same
    run id: "a process of this run"); both wrote and one died on a missing .tmp. The launch id tells them apart."""
    ck = tmp_path / "ck"
    holder = _holder(ck, "launcher", "sweep")   # its own launch id, made by the holding process
    try:
        second = _claim(ck, "rank0", "sweep")
        assert second.returncode != 0
        assert "is in use by run sweep (its launching process, pid" in second.stderr
        assert "both runs have DDTRAIN_RUN_ID=sweep (exported by a script?), but they are two launches" in second.stderr
        result = ddtrain(*ONE, "--epochs", "1", "--steps", "2", "--checkpoint-dir", str(ck),
                         env={**_env(), ownership.RUN_ID_ENV: "sweep"})
        assert_one_clear_error(result, f"--checkpoint-dir {ck} is in use by run sweep", f"pid {holder.pid}",
                               "give each run its own DDTRAIN_RUN_ID")
        assert checkpoint.listing(ck) == []
    finally:
        holder.kill()
        holder.wait()


def test_the_launchers_of_a_multi_node_job_are_one_launch(tmp_path):
    """Every node's launcher of one job (the run id shared_run_id derives) holds the directory together."""
    ck = tmp_path / "ck"
    holder = _holder(ck, "launcher", "nodes-10.0.0.1:29400", nodes=2)
    try:
        node1 = _claim(ck, "launcher", "nodes-10.0.0.1:29400", nodes=2)
        assert node1.returncode == 0 and node1.stdout.strip() == "None", node1.stderr
        single = _claim(ck, "launcher", "nodes-10.0.0.1:29400")   # the same id exported to a one-node run
        assert single.returncode != 0 and "but they are two launches" in single.stderr
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("role", ["launcher", "rank0"])
def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_kept(tmp_path, role):
    """Was: the lock record was written through the link, over the file it pointed at."""
    ck, precious = tmp_path / "ck", tmp_path / "precious.txt"
    ck.mkdir()
    precious.write_text("the only copy\n")
    link = ck / ownership.LOCKS[role]
    link.symlink_to(precious)
    with pytest.raises(DDTrainError, match=re.escape(f"--checkpoint-dir {ck}: its lock file {link} is a symbolic link "
                                                     f"(to {precious}), not a regular file; ")):
        ownership.claim(ck, role)
    assert precious.read_text() == "the only copy\n"
    # a dangling link is not followed to create its target either
    (ck / ownership.LOCKS[role]).unlink()
    (ck / ownership.LOCKS[role]).symlink_to(tmp_path / "created-through-the-link")
    with pytest.raises(DDTrainError, match="is a symbolic link"):
        ownership.claim(ck, role)
    assert not (tmp_path / "created-through-the-link").exists()


@pytest.mark.parametrize("make, what", [(os.mkfifo, "a FIFO (named pipe)"), (os.mkdir, "a folder")])
def test_a_lock_file_that_is_a_fifo_or_a_folder_is_one_line_not_a_hang(tmp_path, make, what):
    """Was: a FIFO blocked the launcher opening it; a folder was an IsADirectoryError traceback."""
    ck = tmp_path / "ck"
    ck.mkdir()
    make(ck / ownership.LOCKS["launcher"])
    result = ddtrain(*ONE, "--epochs", "1", "--steps", "2", "--checkpoint-dir", str(ck), env=_env(), timeout=120)
    assert_one_clear_error(result, f"--checkpoint-dir {ck}: its lock file {ck / ownership.LOCKS['launcher']} is {what}, "
                                   "not a regular file", "remove it")
    assert result.returncode == 2
