"""Faults and bad input, as a user meets them: a worker killed mid-epoch is restarted and the run
ends exactly where an uninterrupted one does; a rank that skips a collective is named within
the deadline; a non-finite loss names step and rank; every bad value is refused before any
worker starts."""
import os
import subprocess
import sys
import time

import pytest
import torch

from helpers import run_skip_fault
from multirank import RankError, run_ranks

from ddtrain import cli, comm
from ddtrain.reliability import checkpoint
from ddtrain.reliability import faults
from ddtrain.reliability import consistency
from ddtrain.distributed import launch
from ddtrain.reliability import stall
from ddtrain.config import TrainConfig
from ddtrain.errors import DDTrainError
from ddtrain.training.build import load_and_build

os.environ.pop("RANK", None)
KILLED = dict(model="mlp", data="digits", epochs=2, batch_size=32, lr=0.05, momentum=0.9, seed=1)


def ddtrain_env(**extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}  # one thread per rank: bitwise-repeatable sums
    env.pop("RANK", None)
    return env


def reference_on_rank():
    """The uninterrupted run, on this pool's 2 ranks, with the settings the CLI run gets."""
    from ddtrain.training.loop import fit
    config = TrainConfig.from_flat(**KILLED, quiet=True)
    data, model = load_and_build(config)
    fit(model, data, config)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow  # 14 s here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path):
    # 23 steps an epoch; rank 1 is SIGKILLed as step 30 starts; checkpoints every 8 steps
    saved, out = tmp_path / "model.pt", tmp_path / "run.json"
    args = ["--model", "mlp", "--data", "digits", "--nproc", "2", "--epochs", "2", "--batch-size", "32",
            "--lr", "0.05", "--momentum", "0.9", "--seed", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--checkpoint-every", "8", "--max-restarts", "1", "--save", str(saved), "--out", str(out)]
    result = subprocess.run([sys.executable, "-m", "ddtrain", "train", *args], capture_output=True, text=True,
                            timeout=300, env=ddtrain_env(DDTRAIN_FAULT="rank=1,step=30,kind=kill"))
    assert result.returncode == 0, result.stderr
    assert "ddtrain: worker rank 1 was killed by SIGKILL; restarting all workers (restart 1 of 1)" in result.stderr
    assert "restart 1: resumed from" in result.stdout and "at step 24 (epoch 2, 1 of its steps done)" in result.stdout
    import json
    record = json.loads(out.read_text())
    resumed = record["reliability"]["resumed_from"]["step"]
    assert record["reliability"]["attempt"] == 1 and 30 - resumed <= 8  # lost at most --checkpoint-every steps
    assert [e["epoch"] for e in record["epochs"]] == [1, 2]
    reference = run_ranks(reference_on_rank, 2)[0]
    final = torch.load(saved, weights_only=True)
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in final)  # bit for bit


@pytest.mark.slow  # 11 s here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_a_rank_that_skips_a_collective_is_named_within_the_deadline():
    deadline = 5
    code, lines, took = run_skip_fault(2, 1, deadline)
    stderr = "\n".join(lines)
    assert code != 0, stderr
    assert took <= deadline + 10, f"{took:.1f} s\n{stderr}"
    stalls = [line for line in lines if "stalled" in line]
    assert len(stalls) == 1, stderr
    assert stalls[0].startswith("[rank 0] ddtrain: error: stalled at step 3 in forward+backward (the gradient "
                                "all-reduce runs inside backward) (strategy ddp, backend gloo): no answer within "
                                f"the {deadline} s deadline; waiting for rank 1 (at step 3: skipping every collective"), stalls[0]
    assert "Traceback" not in stderr


def skip_a_ring_all_reduce(timeout_s: float):
    """Rank 1 never calls the ring all-reduce that rank 0 waits in."""
    import torch.distributed as dist
    with stall.watched(what="strategy ring, backend gloo", timeout_s=timeout_s, period_s=0.2):
        stall.mark(7, "ring all-reduce of the gradients")
        if dist.get_rank() == 1:
            stall.mark(7, "a data-dependent branch that skips the all-reduce")
            time.sleep(timeout_s + 2)  # alive, heartbeat on, but not in the collective
            return "skipped"
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(1000), "ring", timeout_s=timeout_s)
        finally:
            print(f"waited {time.monotonic() - start:.1f} s", file=sys.stderr)


def test_a_skipped_hand_written_collective_names_operation_step_and_peer():
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_ranks(skip_a_ring_all_reduce, 2, 3.0)
    assert time.monotonic() - start <= 3 + 10
    message = caught.value.errors[0].splitlines()[0]
    assert message.startswith("StallError: stalled at step 7 in ring all-reduce of the gradients (strategy ring, "
                              "backend gloo): no answer within the 3 s deadline; waiting for rank 1 (at step 7: "
                              "a data-dependent branch that skips the all-reduce"), message
    assert "ring" in message.split("[", 1)[1] and "rank 1" in message.split("[", 1)[1]  # comm's own words
    assert 1 not in caught.value.errors


def test_a_nonfinite_loss_stops_naming_step_and_rank():
    from ddtrain.training.loop import fit
    config = TrainConfig.from_flat(model="mlp", data="digits", batch_size=64, steps=5, quiet=True)
    data, model = load_and_build(config)
    faults._fault = faults._parse("rank=0,step=3,kind=nan")
    try:
        with pytest.raises(DDTrainError, match=r"^non-finite loss \(nan\) on rank 0 at step 3; lower the learning "
                           r"rate \(lr, --lr\), "
                                                 r"check the data, or pass on_nonfinite='skip' \(--on-nonfinite skip\)$"):
            fit(model, data, config)
    finally:
        faults._fault = None
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the bad step never reached the weights


# ---- bad input: refused in the parent, before any worker starts ----------------------------

@pytest.fixture
def dirs(tmp_path):
    """Checkpoint folders: one that fits a batch-64 mlp run, one only damaged, one plain file."""
    config = TrainConfig.from_flat(model="mlp", data="digits", batch_size=64)
    data, model = load_and_build(config, meta=True)
    fits = tmp_path / "fits"
    checkpoint.write(checkpoint.path_for(fits, 7),
                     {"step": 7, "fingerprint": consistency.fingerprint(config, model, data, 2)}, {})
    damaged = tmp_path / "damaged"
    path = checkpoint.write(checkpoint.path_for(damaged, 3), {"step": 3}, {"w": torch.ones(3)})
    path.write_bytes(path.read_bytes()[:-7])
    (tmp_path / "file").write_text("not a folder")
    return tmp_path


BAD = [
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--resume", "--checkpoint-dir", "{d}/none"], "--resume finds no checkpoint in {d}/none"),
    (["--checkpoint-dir", "{d}/fits"], "already holds checkpoints (newest: ckpt-00000007.pt); pass --resume"),
    (["--checkpoint-dir", "{d}/file"], "--checkpoint-dir '{d}/file' is a file, not a directory"),
    (["--resume", "--checkpoint-dir", "{d}/damaged"], "--resume finds every checkpoint in {d}/damaged damaged: "
                                                       "ckpt-00000003.pt (truncated: "),
    (["--resume", "--checkpoint-dir", "{d}/fits", "--batch-size", "16"],
     "does not fit this run: it has batch_size=64 vs 16"),
    (["--strategy", "ps-async", "--checkpoint-dir", "{d}/new"], "--checkpoint-dir is not supported with strategy 'ps-async'"),
    (["--keep", "0"], "--keep must be a positive integer, got 0"),
    (["--max-restarts", "-1"], "--max-restarts must be a non-negative integer, got -1"),
    (["--on-nonfinite", "explode"], "argument --on-nonfinite: invalid choice: 'explode' (choose from 'stop', 'skip')"),
    (["--on-mismatch", "ignore"], "argument --on-mismatch: invalid choice: 'ignore'"),
    (["--timeout", "nan"], "--timeout must be a positive number of seconds, got nan"),
    (["--timeout", "inf"], "--timeout must be a positive number of seconds, got inf"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--seed", "-1"], "--seed must be a non-negative integer, got -1"),
    (["--epochs", "-1"], "--epochs must be a non-negative integer, got -1"),
    (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    (["--batch-size", "x"], "argument --batch-size: invalid int value: 'x'"),
    (["--out", "/etc/passwd/run.json"], "--out '/etc/passwd/run.json': /etc/passwd is not a directory"),
    (["--save", "{d}"], "--save '{d}' is a directory; give a file name"),
    (["--model-arg", "widht=3"], "model 'mlp': build_mlp() got an unexpected keyword argument 'widht'"),
    (["--data-arg", "colour=3"], "--data digits: load_digits() got an unexpected keyword argument 'colour'"),
]


@pytest.mark.parametrize("args,phrase", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_refused_before_any_worker_starts(dirs, args, phrase, monkeypatch, capsys):
    def no_workers(*_args, **_kwargs):
        raise AssertionError("workers were started")
    monkeypatch.setattr(launch, "run_local", no_workers)
    argv = ["train", "--model", "mlp", "--data", "digits", "--nproc", "2",
            *[a.replace("{d}", str(dirs)) for a in args]]
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and phrase.replace("{d}", str(dirs)) in errors[0], err


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_nccl_without_gpus_is_refused_before_any_worker_starts(monkeypatch, capsys):
    monkeypatch.setattr(launch, "run_local", lambda *a, **k: pytest.fail("workers were started"))
    assert cli.main(["train", "--model", "mlp", "--nproc", "2", "--backend", "nccl"]) == 2
    assert "--backend nccl needs a GPU per worker: 2 workers, " in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_on_nccl_a_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path):
    # the CUDA paths: GPU RNG states, NCCL object collectives for the gather and the scatter
    common = ["--model", "mlp", "--data", "digits", "--nproc", "2", "--epochs", "2", "--batch-size", "32",
              "--lr", "0.05", "--momentum", "0.9", "--seed", "1", "--backend", "nccl", "--quiet",
              "--model-arg", "dropout=0.2"]
    plain = subprocess.run([sys.executable, "-m", "ddtrain", "train", *common, "--save", str(tmp_path / "plain.pt")],
                           capture_output=True, text=True, timeout=300, env=ddtrain_env())
    assert plain.returncode == 0, plain.stderr
    killed = subprocess.run([sys.executable, "-m", "ddtrain", "train", *common, "--save", str(tmp_path / "killed.pt"),
                             "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "8",
                             "--max-restarts", "1"], capture_output=True, text=True, timeout=300,
                            env=ddtrain_env(DDTRAIN_FAULT="rank=1,step=30,kind=kill"))
    assert killed.returncode == 0, killed.stderr
    assert "restart 1: resumed from" in killed.stdout and "at step 24 (epoch 2, 1 of its steps done)" in killed.stdout
    a = torch.load(tmp_path / "plain.pt", weights_only=True)
    b = torch.load(tmp_path / "killed.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
