"""A resume over other data of the same size and shape is refused, naming what differs (issue 32).

Before: only the data set's size and sample shape were compared, so ``--resume`` over a file
whose labels were permuted went on without a word. The fingerprint now holds a checksum of every
label and of a fixed sample of inputs (``consistency.data_checksums``); ``--resume-data-change``
resumes anyway.
"""
from __future__ import annotations

import numpy as np
import pytest

from ddtrain import TrainConfig, fit
from ddtrain.errors import DDTrainError
from ddtrain.reliability import consistency
from ddtrain.training.build import load_and_build


def npz(path, labels_seed=None, inputs_seed=0):
    rng = np.random.default_rng(inputs_seed)
    x = rng.random((64, 1, 6, 6)).astype("float32")
    y = np.arange(64) % 4
    if labels_seed is not None:
        y = np.random.default_rng(labels_seed).permutation(y)
    np.savez(path, x=x, y=y)
    return f"npz:{path}"


def train(data, folder, **settings):
    config = TrainConfig.from_flat(model="mlp", data=data, batch_size=8, epochs=1, quiet=True, val_fraction=0.0,
                                   checkpoint_dir=str(folder), checkpoint_every=3, **settings)
    dataset, model = load_and_build(config)
    return fit(model, dataset, config)


def test_a_resume_on_permuted_labels_is_refused_and_the_override_resumes(tmp_path):
    data = npz(tmp_path / "a.npz")
    train(data, tmp_path / "ck", steps=3)
    npz(tmp_path / "a.npz", labels_seed=1)   # the same file name, its labels permuted
    with pytest.raises(DDTrainError, match=r"does not fit this run: it has other training data of the same size and "
                                           r"shape: its labels differ \(checksum [0-9a-f]{16} vs [0-9a-f]{16}; to "
                                           r"train on this data anyway: --resume-data-change\)"):
        train(data, tmp_path / "ck", steps=6, resume=True)
    record = train(data, tmp_path / "ck", steps=6, resume=True, resume_data_change=True)
    assert record["reliability"]["resumed_from"]["step"] == 3
    train(data, tmp_path / "ck", steps=8, resume=True)   # the data its newest checkpoint was written on: resumes


def test_the_checksums_see_labels_and_inputs_and_nothing_else(tmp_path):
    def sums(path):
        return consistency.data_checksums(load_and_build(TrainConfig.from_flat(
            model="mlp", data=path, val_fraction=0.0), meta=True)[0].train)
    same, again = sums(npz(tmp_path / "a.npz")), sums(npz(tmp_path / "a2.npz"))
    assert same == again and None not in same.values()
    labels = sums(npz(tmp_path / "b.npz", labels_seed=1))
    assert labels["train_labels"] != same["train_labels"] and labels["train_inputs"] == same["train_inputs"]
    inputs = sums(npz(tmp_path / "c.npz", inputs_seed=5))
    assert inputs["train_inputs"] != same["train_inputs"] and inputs["train_labels"] == same["train_labels"]
