"""``ddtrain checkpoint info``: a whole checkpoint's step, configuration, size, resumable worker counts and integrity;
a damaged one named with what is wrong and a non-zero exit."""
import os
import shutil

import pytest
import torch

from helpers import ddtrain

from ddtrain.cli import main
from ddtrain import TrainConfig, fit
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.models import build_model
from ddtrain.reliability import checkpoint
from ddtrain.reliability.checkpoint_info import inspect

os.environ.pop("RANK", None)  # trains in this process, a world of one


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    g = torch.Generator().manual_seed(1)
    data = Data("synthetic", ArrayDataset(torch.randn(1000, 1, 8, 8, generator=g), torch.randint(0, 10, (1000,), generator=g),
                                          num_classes=10), None, 10, (1, 8, 8), "classification")
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=10, in_channels=1, input_size=(8, 8), hidden=(32, 16))
    folder = tmp_path_factory.mktemp("info") / "ckpt"
    config = TrainConfig.from_flat(model="mlp", data="synthetic", steps=12, global_batch_size=96, grad_accum=2,
                                   lr=0.05, seed=3, val_fraction=0.0, quiet=True, checkpoint_dir=str(folder),
                                   checkpoint_every=6)
    fit(model, data, config)
    return folder


def info(capsys, target) -> tuple[int, str, str]:
    """``ddtrain checkpoint info TARGET`` run in this process: (exit status, stdout, stderr)."""
    code = main(["checkpoint", "info", str(target)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_whole_checkpoint_is_described_and_verified(written, capsys):
    code, out, err = info(capsys, written / "ckpt-00000012.pt")
    assert code == 0, err
    assert "step:          12 (epoch 2, 2 of its steps done)" in out   # 10 steps an epoch: 1000 samples, 96 a step
    assert ("configuration: strategy ddp, model mlp, data synthetic (1000 training samples), global batch 96, "
            "grad-accum 2, 1 workers, seed 3") in out
    assert f"size:          {(written / 'ckpt-00000012.pt').stat().st_size} bytes" in out
    assert "resumes on:    1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96 workers" in out
    assert "integrity:     ok" in out


def test_a_damaged_checkpoint_names_what_is_wrong_and_exits_non_zero(written, tmp_path, capsys):
    folder = shutil.copytree(written, tmp_path / "ckpt")
    newest = folder / "ckpt-00000012.pt"
    data = bytearray(newest.read_bytes())
    data[-500] ^= 0xFF          # one flipped byte inside the payload
    newest.write_bytes(bytes(data))
    code, out, _ = info(capsys, newest)
    assert code == 1
    assert "integrity:     DAMAGED: checksum mismatch (the bytes changed after writing)" in out
    assert "step:          12" in out      # the header is still readable and shown
    # the directory: every file, the newest whole one named, non-zero because one is damaged
    infos = inspect(folder)
    assert [(i.path.name, i.problem is None) for i in infos] == [("ckpt-00000012.pt", False), ("ckpt-00000006.pt", True)]
    code, out, _ = info(capsys, folder)
    assert code == 1 and "# 2 checkpoints, newest whole: ckpt-00000006.pt; damaged: ckpt-00000012.pt" in out
    truncated = folder / "ckpt-00000006.pt"
    truncated.write_bytes(truncated.read_bytes()[:-10])
    assert inspect(truncated)[0].problem.startswith("truncated: ")


def test_info_on_nothing_is_one_clear_error(tmp_path):
    """The real command, as a user runs it: one line, no traceback."""
    result = ddtrain("checkpoint", "info", str(tmp_path), timeout=120)
    assert result.returncode != 0 and "no checkpoint files" in result.stderr
    assert "Traceback" not in result.stderr
    assert checkpoint.listing(tmp_path) == []


def test_a_checkpoint_rotated_away_while_the_directory_is_read_is_gone_not_damaged(written, tmp_path, capsys,
                                                                                   monkeypatch):
    """Was: ``checkpoint info`` polled while a run rotated its checkpoints called the removed file DAMAGED
    ("unreadable: No such file or directory") and exited 1."""
    folder = shutil.copytree(written, tmp_path / "ckpt")
    real_listing = checkpoint.listing

    def rotated_after_listing(directory):
        found = real_listing(directory)
        (folder / "ckpt-00000006.pt").unlink()   # the writer's rotation, between the listing and the reading
        return found
    monkeypatch.setattr(checkpoint, "listing", rotated_after_listing)
    code, out, err = info(capsys, folder)
    assert code == 0, out + err
    assert "integrity:     gone: removed while being read (rotated away by the run writing this directory); " \
           "not damaged" in out
    assert "# 2 checkpoints, newest whole: ckpt-00000012.pt; gone while read (rotated): ckpt-00000006.pt" in out
    assert "DAMAGED" not in out


def test_a_file_removed_once_open_is_read_whole(written, tmp_path, monkeypatch):
    """Header and payload are read through one descriptor: a rotation after the open changes nothing."""
    path = shutil.copy(written / "ckpt-00000012.pt", tmp_path / "ckpt-00000012.pt")
    real_open = checkpoint._open

    def open_then_rotate(p):
        f = real_open(p)
        os.unlink(p)
        return f
    monkeypatch.setattr(checkpoint, "_open", open_then_rotate)
    header, payload = checkpoint.read(path)
    assert header["step"] == 12 and len(payload["ranks"]) == 1


def test_info_on_a_directory_holding_a_fifo_is_one_answer_not_a_hang(written, tmp_path):
    """Was: ``checkpoint info`` blocked for ever opening a FIFO named like a checkpoint."""
    folder = shutil.copytree(written, tmp_path / "ckpt")
    os.mkfifo(folder / "ckpt-00000099.pt")
    os.mkfifo(folder / "notes")   # not named like a checkpoint: not looked at
    result = ddtrain("checkpoint", "info", str(folder), timeout=120)
    assert result.returncode == 1, result.stderr
    assert "integrity:     DAMAGED: not a checkpoint: it is a FIFO (named pipe), not a regular file" in result.stdout
    assert "newest whole: ckpt-00000012.pt; damaged: ckpt-00000099.pt" in result.stdout
    alone = ddtrain("checkpoint", "info", str(folder / "ckpt-00000099.pt"), timeout=120)
    assert alone.returncode == 1 and "it is a FIFO (named pipe)" in alone.stdout
    assert "Traceback" not in result.stderr + alone.stderr
