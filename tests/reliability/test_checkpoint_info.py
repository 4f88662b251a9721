"""``ddtrain checkpoint info``: a whole checkpoint's step, configuration, size, resumable worker counts and integrity;
a damaged one named with what is wrong and a non-zero exit."""
import os
import shutil

import pytest
import torch

from helpers import ddtrain

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


def test_a_whole_checkpoint_is_described_and_verified(written):
    result = ddtrain("checkpoint", "info", str(written / "ckpt-00000012.pt"), timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "step:          12 (epoch 2, 2 of its steps done)" in out   # 10 steps an epoch: 1000 samples, 96 a step
    assert ("configuration: strategy ddp, model mlp, data synthetic (1000 training samples), global batch 96, "
            "grad-accum 2, 1 workers (world size 1), seed 3") in out
    assert f"size:          {(written / 'ckpt-00000012.pt').stat().st_size} bytes" in out
    assert "resumes on:    1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96 workers" in out
    assert "integrity:     ok" in out


def test_a_damaged_checkpoint_names_what_is_wrong_and_exits_non_zero(written, tmp_path):
    folder = shutil.copytree(written, tmp_path / "ckpt")
    newest = folder / "ckpt-00000012.pt"
    data = bytearray(newest.read_bytes())
    data[-500] ^= 0xFF          # one flipped byte inside the payload
    newest.write_bytes(bytes(data))
    result = ddtrain("checkpoint", "info", str(newest), timeout=120)
    assert result.returncode == 1
    assert "integrity:     DAMAGED: checksum mismatch (the bytes changed after writing)" in result.stdout
    assert "step:          12" in result.stdout      # the header is still readable and shown
    # the directory: every file, the newest whole one named, non-zero because one is damaged
    infos = inspect(folder)
    assert [(i.path.name, i.problem is None) for i in infos] == [("ckpt-00000012.pt", False), ("ckpt-00000006.pt", True)]
    truncated = folder / "ckpt-00000006.pt"
    truncated.write_bytes(truncated.read_bytes()[:-10])
    assert inspect(truncated)[0].problem.startswith("truncated: ")


def test_info_on_nothing_is_one_clear_error(tmp_path):
    result = ddtrain("checkpoint", "info", str(tmp_path), timeout=120)
    assert result.returncode != 0 and "no checkpoint files" in result.stderr
    assert "Traceback" not in result.stderr
    assert checkpoint.listing(tmp_path) == []
