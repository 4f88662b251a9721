"""``on_nonfinite="skip"`` is bounded, and a run that ended diverged does not count as a success (issue 32).

Before: ``--on-nonfinite skip`` with every step non-finite exited 0 after skipping 67 of 69 steps
and saved a model at loss 2.4e28; and a skipped step's NaN loss went into the epoch's train loss.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from ddtrain import TrainConfig, fit
from ddtrain.errors import DDTrainError
from ddtrain.reliability import nonfinite
from ddtrain.training.build import load_and_build

BASE = dict(model="mlp", data="digits", batch_size=64, lr=0.05, seed=0, quiet=True, val_fraction=0.2,
            model_args={"hidden": (16,)}, on_nonfinite="skip")


def nan_loss_at(bad):
    """A cross-entropy whose value is NaN at the calls ``bad(call)`` says (one call per step here)."""
    calls = [0]

    def loss(out, y):
        calls[0] += 1
        value = F.cross_entropy(out, y)
        return value * float("nan") if bad(calls[0] - 1) else value
    return loss


def train(tmp_path, bad, **settings):
    config = TrainConfig.from_flat(**{**BASE, "out": str(tmp_path / "run.json"), "save": str(tmp_path / "model.pt"),
                                      **settings})
    data, model = load_and_build(config)
    return fit(model, data, config, loss_fn=nan_loss_at(bad))


def test_every_step_non_finite_stops_after_ten_in_a_row(tmp_path):
    with pytest.raises(DDTrainError, match=r"^non-finite loss at 10 steps in a row \(steps 0 to 9, each skipped "
                                           r"on every rank by on_nonfinite='skip', --on-nonfinite skip; 10 skipped "
                                           r"in all\): training is not recovering, stopped; lower the learning rate"):
        train(tmp_path, lambda call: True, steps=40)
    assert not (tmp_path / "model.pt").exists()


def test_most_steps_skipped_fails_the_run_with_the_record_and_no_model(tmp_path):
    # 2 of every 3 steps non-finite: never 10 in a row, but the model hardly trained
    with pytest.raises(DDTrainError, match=r"^training failed: 14 of its 21 steps had a non-finite loss or gradients "
                                           r"and were skipped .*; the record .*run.json says so, and --save "
                                           r".*model.pt was not written$"):
        train(tmp_path, lambda call: call % 3 != 2, steps=21)
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["reliability"]["nonfinite_skipped_steps"] == 14
    assert record["reliability"]["nonfinite_failed"].startswith("14 of its 21 steps")
    assert not (tmp_path / "model.pt").exists()


def test_a_few_skipped_steps_leave_a_finite_train_loss_and_are_counted(tmp_path):
    record = train(tmp_path, lambda call: call in (3, 7), steps=12)
    assert record["reliability"]["nonfinite_skipped_steps"] == 2
    assert [s["step"] for s in record["reliability"]["nonfinite_skipped"]] == [3, 7]
    assert math.isfinite(record["epochs"][-1]["train_loss"])     # was nan: the skipped steps' losses counted
    assert (tmp_path / "model.pt").exists()


def test_a_last_epoch_with_a_non_finite_loss_is_no_success():
    """On a GPU stop mode checks every 50th step only: a divergence between checks is caught at the end."""
    info = {"nonfinite_skipped": []}
    guard = nonfinite.NonfiniteGuard("stop", module=torch.nn.Linear(2, 2), scaler=None, device=torch.device("cpu"),
                                     group=None, info=info)
    assert guard.finish(30, {"train_loss": 0.4, "val_loss": 0.5}) is None
    why = guard.finish(30, {"train_loss": float("nan"), "val_loss": float("inf")})
    assert why.startswith("the last epoch's train_loss nan and val_loss inf is not finite: the model diverged")
    assert info["nonfinite_failed"] == why
