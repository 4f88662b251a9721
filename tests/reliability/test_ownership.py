"""One run per checkpoint directory (issue 22): a second run is refused naming the owner, a dead
run's lock is taken over, a restart of the same run is let in, every checkpoint names its run, and
--resume continues only the directory's own lineage unless --resume-any says otherwise."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, assert_one_clear_error, ddtrain
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
    # earlier test set this process's run id; every command here is a run of its own
    env[ownership.RUN_ID_ENV] = ""
    return env


def _holder(directory, role, run_id):
    """A process of another run holding ``directory``'s ``role`` lock until killed."""
    code = (f"import sys, time; from ddtrain.reliability import ownership; "
            f"ownership.claim(sys.argv[1], {role!r}); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(directory)], stdout=subprocess.PIPE, text=True,
                            env={**_env(), ownership.RUN_ID_ENV: run_id})
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


def test_processes_of_one_run_share_the_lock(tmp_path):
    """A torchrun restart is the same run: its rank 0 may take the lock its launcher holds."""
    ck = tmp_path / "ck"
    holder = _holder(ck, "launcher", "same-run")
    try:
        code = ("import sys; from ddtrain.reliability import ownership; "
                "print(ownership.claim(sys.argv[1], 'rank0'))")
        ok = subprocess.run([sys.executable, "-c", code, str(ck)], capture_output=True, text=True,
                            env={**_env(), ownership.RUN_ID_ENV: "same-run"})
        assert ok.returncode == 0 and ok.stdout.strip() == "None", ok.stderr
        other = subprocess.run([sys.executable, "-c", code, str(ck)], capture_output=True, text=True,
                               env={**_env(), ownership.RUN_ID_ENV: "other-run"})
        assert other.returncode != 0 and "is in use by run same-run" in other.stderr
    finally:
        holder.kill()
        holder.wait()
