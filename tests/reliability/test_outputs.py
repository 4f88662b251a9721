"""Outputs never clobber inputs or each other (issue 22): refused in the launching process before any
worker starts, naming both paths; a final save that fails (a full disk) keeps the model and says where."""
import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import assert_one_clear_error, ddtrain
from ddtrain.config import TrainConfig
from ddtrain.errors import DDTrainError
from ddtrain.observe import files
from ddtrain.reliability import outputs
from ddtrain.training.build import load_and_build
from ddtrain.training.loop import fit

os.environ.pop("RANK", None)


@pytest.fixture
def npz(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "train.npz"
    np.savez(path, x=rng.normal(size=(40, 6, 6)).astype("float32"), y=rng.integers(0, 3, 40))
    return path


def test_save_onto_the_training_data_is_refused_and_the_data_survives(npz, tmp_path):
    """Was: exit 0, and the .npz replaced by the model: the data set destroyed."""
    before = npz.read_bytes()
    result = ddtrain("train", "--nproc", "1", "--model", "mlp", "--batch-size", "4", "--data", f"npz:{npz}",
                     "--save", str(npz), env={"OMP_NUM_THREADS": "1"})
    assert_one_clear_error(result, f"--save {npz} is the data set itself (--data npz:{npz})")
    assert result.returncode == 2 and npz.read_bytes() == before


def test_out_and_save_on_one_path_are_refused(tmp_path):
    """Was: exit 0, the record replaced by the model."""
    x = tmp_path / "x.json"
    result = ddtrain("train", "--nproc", "1", "--model", "mlp", "--batch-size", "4", "--out", str(x), "--save", str(x),
                     env={"OMP_NUM_THREADS": "1"})
    assert_one_clear_error(result, f"--out and --save name the same path {x}")
    assert not x.exists()


def config(**flat):
    return TrainConfig.from_flat(model="mlp", **flat)


def test_every_kind_of_clash_names_both_paths(npz, tmp_path):
    folder = tmp_path / "images"
    (folder / "cat").mkdir(parents=True)
    link = tmp_path / "link.npz"
    link.symlink_to(npz)
    cases = [
        (dict(data=f"npz:{npz}", out=str(link)), "--out", "is the data set itself"),   # through a symlink
        (dict(data=f"imagefolder:{folder}", save=str(folder / "cat" / "m.pt")), "--save", "lies inside the data set's folder"),
        (dict(data=f"imagefolder:{folder}", checkpoint_dir=str(tmp_path)), "--checkpoint-dir", "contains the data set"),
        (dict(data=f"npz:{npz}", checkpoint_dir=str(npz)), "--checkpoint-dir", "is the data set itself"),
        (dict(trace=str(tmp_path / "t.json"), out=str(tmp_path / "t.json")), "--out", "name the same path"),
        (dict(checkpoint_dir=str(tmp_path / "ck"), save=str(tmp_path / "ck" / "ckpt-00000001.pt")), "--save",
         "named like a checkpoint"),
    ]
    for flat, flag, phrase in cases:
        with pytest.raises(DDTrainError) as info:
            outputs.check(config(**flat))
        assert flag in str(info.value) and phrase in str(info.value), (flat, str(info.value))
    # what stays allowed: outputs next to the data, a model file inside the checkpoint folder
    outputs.check(config(data=f"npz:{npz}", out=str(tmp_path / "run.json"), save=str(tmp_path / "model.pt"),
                         checkpoint_dir=str(tmp_path / "ck")))
    outputs.check(config(checkpoint_dir=str(tmp_path / "ck"), save=str(tmp_path / "ck" / "final.pt")))


def test_a_full_disk_at_the_final_save_keeps_the_model_and_says_where(tmp_path, monkeypatch, capsys):
    """Was: the trained model lost behind '[enforce fail at inline_container.cc:672]'."""
    target = tmp_path / "full" / "model.pt"
    target.parent.mkdir()
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):  # the target's filesystem is full; others are not
        if Path(str(f)).parent == target.parent:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        return real_save(obj, f, *args, **kwargs)
    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cfg = TrainConfig.from_flat(model="mlp", data="digits", batch_size=64, epochs=1, steps=5, quiet=True,
                                save=str(target), out=str(tmp_path / "run.json"))
    data, model = load_and_build(cfg)
    with pytest.raises(DDTrainError) as info:
        fit(model, data, cfg)
    message = str(info.value)
    rescued = tmp_path / "tmp" / f"ddtrain-rescued-{os.getpid()}-model.pt"
    assert message.startswith(f"--save {target}: could not write the trained model (the write failed, most likely "
                              f"a full disk); it was saved to {rescued} instead"), message
    assert not target.exists() and not list(target.parent.iterdir())  # no temporary file left either
    saved = torch.load(rescued, weights_only=True)
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert (tmp_path / "run.json").exists()


def test_a_full_disk_for_the_record_keeps_it_elsewhere_with_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    target = tmp_path / "full" / "run.json"
    real = files.atomic_write

    def full(path, write):
        if Path(path).parent == target.parent:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, write)
    monkeypatch.setattr(files, "atomic_write", full)
    got = files.write_json(target, {"val_loss": float("nan")})
    assert got == tmp_path / f"ddtrain-rescued-{os.getpid()}-run.json" and got.read_text().count("null") == 1
    assert f"{target}: could not write the results record (No space left on device); it was saved to {got}" \
        in capsys.readouterr().err
