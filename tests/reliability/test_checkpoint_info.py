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
