"""Checkpoints: an interrupted run resumed from one ends bit for bit where an uninterrupted run ends;
damaged files are detected and skipped, half-written ones never replace a good one, and a
checkpoint file cannot execute code."""
import hashlib
import json
import os
import pickle
import shutil

import pytest
import torch

from pathlib import Path

from ddtrain.reliability import checkpoint
from ddtrain.config import TrainConfig
from ddtrain.errors import DDTrainError
from ddtrain.training.loop import fit
from ddtrain.training.build import load_and_build

os.environ.pop("RANK", None)  # these tests train in this process, a world of one

# 23 steps an epoch (1437 digits, batch 64): 30 steps cross an epoch boundary; dropout uses the RNG.
SETTINGS = dict(model="mlp", data="digits", batch_size=64, lr=0.05, momentum=0.9, seed=3, epochs=2, steps=30, quiet=True,
                model_args={"hidden": (32,), "dropout": 0.2})


def train(**overrides):
    config = TrainConfig.from_flat(**{**SETTINGS, **overrides})
    data, model = load_and_build(config)
    record = fit(model, data, config)
    return model.state_dict(), record


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run."""
    return train()


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run stopped after 17 of its 30 steps (mid-epoch 1), checkpoints every 7 steps, keeping 3."""
    folder = tmp_path_factory.mktemp("stopped") / "ckpt"
    train(steps=17, checkpoint_dir=str(folder), checkpoint_every=7, keep=3)
    return folder


@pytest.fixture
def interrupted(stopped_run, tmp_path):
    """A fresh copy of the stopped run's checkpoints for each test."""
    return Path(shutil.copytree(stopped_run, tmp_path / "ckpt"))


def test_resume_mid_epoch_is_step_for_step_identical(reference, interrupted):
    assert [p.name for _, p in checkpoint.listing(interrupted)] == \
        ["ckpt-00000017.pt", "ckpt-00000014.pt", "ckpt-00000007.pt"]
    state, record = train(checkpoint_dir=str(interrupted), checkpoint_every=7, keep=3, resume=True)
    assert record["reliability"]["resumed_from"]["step"] == 17
    assert same(state, reference[0])
    # the epoch the checkpoint stopped in reports the same training loss as the uninterrupted one
    assert [e["train_loss"] for e in record["epochs"]] == [e["train_loss"] for e in reference[1]["epochs"]]
    assert [p.name for _, p in checkpoint.listing(interrupted)] == \
        ["ckpt-00000030.pt", "ckpt-00000028.pt", "ckpt-00000021.pt"]  # rotated, --keep 3


def test_truncated_checkpoint_is_detected_and_the_previous_one_used(reference, interrupted, capsys):
    newest = interrupted / "ckpt-00000017.pt"
    newest.write_bytes(newest.read_bytes()[:-100])
    state, record = train(checkpoint_dir=str(interrupted), checkpoint_every=7, resume=True)
    warning = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged (truncated:" in warning, warning
    assert record["reliability"]["resumed_from"]["step"] == 14
    assert same(state, reference[0])  # nothing lost but the 3 steps since step 14
    assert (interrupted / "ckpt-00000017.pt.damaged").exists()  # kept aside for inspection


@pytest.mark.parametrize("damage,why", [
    (lambda b: b[:-1], "truncated: "),
    (lambda b: b + b"x", "too long: "),
    (lambda b: b[:-5] + bytes([b[-5] ^ 1]) + b[-4:], "checksum mismatch"),
    (lambda b: b"PK" + b[2:], "not a ddtrain checkpoint"),
    (lambda b: b[:30], "truncated"),
])
def test_every_kind_of_damage_is_detected(tmp_path, damage, why):
    path = checkpoint.write(tmp_path / "ckpt-00000001.pt", {"step": 1}, {"w": torch.arange(10.0)})
    assert torch.equal(checkpoint.read(path)[1]["w"], torch.arange(10.0))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(checkpoint.Damaged, match=why):
        checkpoint.read(path)


def test_a_crash_mid_write_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    good = checkpoint.write(checkpoint.path_for(tmp_path, 5), {"step": 5}, {"w": torch.ones(3)})
    real_replace = os.replace

    def crash(*args):
        raise KeyboardInterrupt("killed between writing and renaming")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.write(checkpoint.path_for(tmp_path, 5), {"step": 5}, {"w": torch.zeros(3)})
    monkeypatch.setattr(os, "replace", real_replace)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000005.pt"]  # no temporary file left behind
    assert torch.equal(checkpoint.read(good)[1]["w"], torch.ones(3))
    # a process killed outright leaves its temporary file: never read, removed by the next rotation
    (tmp_path / ".ckpt-00000010.pt.x1y2.tmp").write_bytes(b"half a checkpoint")
    assert checkpoint.newest(tmp_path)[0] == good
    checkpoint.rotate(tmp_path, keep=3)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000005.pt"]


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ddtrain-checkpoint-pwned",))


def test_a_checkpoint_cannot_execute_code(tmp_path):
    marker = "/tmp/ddtrain-checkpoint-pwned"
    if os.path.exists(marker):
        os.remove(marker)
    path = tmp_path / "ckpt-00000001.pt"
    checkpoint.write(path, {"step": 1}, {"w": torch.ones(1)})
    header, _ = checkpoint.read_header(path)
    evil = pickle.dumps({"w": _Payload()}, protocol=2)  # a well-formed file whose payload would run a command
    header.update(payload_bytes=len(evil), sha256=hashlib.sha256(evil).hexdigest())
    header["header_sha256"] = checkpoint.header_checksum(header)  # a forger recomputes every checksum
    path.write_bytes(checkpoint.MAGIC + json.dumps(header).encode() + b"\n" + evil)
    with pytest.raises(checkpoint.Damaged, match=r"weights_only"):
        checkpoint.read(path)
    assert not os.path.exists(marker)


def test_resume_refuses_a_checkpoint_of_another_configuration(interrupted):
    with pytest.raises(DDTrainError, match=r"does not fit this run: it has batch_size=64 vs 32"):
        train(checkpoint_dir=str(interrupted), resume=True, batch_size=32)


# ---- the learning-rate schedule across a resume ----

COSINE = dict(SETTINGS, lr_schedule="cosine", lr_warmup_steps=3)


class Crash(Exception):
    pass


class CrashAfter:
    """A callback that ends the run with an exception after ``step`` (its checkpoint is written by then)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, step, logs, state):
        if step == self.step:
            raise Crash(step)


def train_cosine(callbacks=(), **overrides):
    config = TrainConfig.from_flat(**{**COSINE, **overrides})
    data, model = load_and_build(config)
    record = fit(model, data, config, callbacks=callbacks)
    return model.state_dict(), record


def test_a_run_resumed_mid_schedule_takes_the_uninterrupted_runs_learning_rates(tmp_path):
    """Cosine over 30 steps (3 of warm-up), crashed at step 17 and resumed: the lr of updates 18-30 is the schedule's,
    not a schedule restarted at update 0 (which would end on other parameters)."""
    reference, _ = train_cosine()
    folder = tmp_path / "ckpt"
    with pytest.raises(Crash):
        train_cosine([CrashAfter(17)], checkpoint_dir=str(folder), checkpoint_every=17)
    state, record = train_cosine(checkpoint_dir=str(folder), checkpoint_every=17, resume=True)
    assert record["reliability"]["resumed_from"]["step"] == 17
    assert same(state, reference)


@pytest.fixture(scope="module")
def cosine_stopped(tmp_path_factory):
    """A cosine run of --steps 17 (its checkpoint written at its last step)."""
    folder = tmp_path_factory.mktemp("cosine") / "ckpt"
    train_cosine(steps=17, checkpoint_dir=str(folder))
    return folder


def test_a_resume_that_changes_the_schedule_is_refused_naming_the_setting(cosine_stopped, tmp_path):
    """--steps 17 resumed with --steps 30: cosine over 17 updates so far, over 30 now; an uninterrupted 30-step run
    would have trained updates 4-16 at other rates. Refused, naming the setting and the two schedules."""
    folder = Path(shutil.copytree(cosine_stopped, tmp_path / "ckpt"))
    before = {p.name: p.read_bytes() for _, p in checkpoint.listing(folder)}
    with pytest.raises(DDTrainError, match=r"another learning-rate schedule than this run's: steps 17 -> 30: "
                                           r"cosine over 17 updates after 3 warm-up -> cosine over 30 updates "
                                           r"after 3 warm-up; update 4 trained at 0.9875 x the peak lr, which "
                                           r"these settings give 0.9966; .* --resume-schedule-change"):
        train_cosine(steps=30, checkpoint_dir=str(folder), resume=True)
    assert {p.name: p.read_bytes() for _, p in checkpoint.listing(folder)} == before
    with pytest.raises(DDTrainError, match=r"lr_schedule 'cosine' -> 'linear'"):
        train_cosine(steps=17, lr_schedule="linear", checkpoint_dir=str(folder), resume=True)


def test_with_resume_schedule_change_the_resume_proceeds_and_says_so(cosine_stopped, tmp_path, capsys):
    folder = Path(shutil.copytree(cosine_stopped, tmp_path / "ckpt"))
    _, record = train_cosine(steps=30, checkpoint_dir=str(folder), resume=True, resume_schedule_change=True)
    resumed = record["reliability"]["resumed_from"]
    assert resumed["step"] == 17 and resumed["schedule_changed"].startswith("steps 17 -> 30: ")
    assert "note: --resume-schedule-change: the learning-rate schedule changes at update 17 (steps 17 -> 30" \
        in capsys.readouterr().out
    assert sum(e["steps"] for e in record["epochs"]) == 30


def test_more_steps_at_a_constant_rate_resume_without_a_word(interrupted, capsys):
    """The existing resume: --steps 17 then --steps 30 at a constant lr trains what an uninterrupted 30-step run does."""
    _, record = train(checkpoint_dir=str(interrupted), resume=True)
    assert "schedule_changed" not in record["reliability"]["resumed_from"]
    assert "resume-schedule-change" not in capsys.readouterr().out


@pytest.mark.slow  # two `ddtrain train` commands
def test_the_command_line_refuses_a_schedule_change_in_one_line_and_proceeds_with_the_flag(tmp_path):
    from helpers import assert_one_clear_error, ddtrain
    run = ["train", "--model", "mlp", "--data", "digits", "--batch-size", "64", "--lr-schedule", "cosine",
           "--warmup-steps", "3", "--quiet", "--checkpoint-dir", str(tmp_path / "ckpt")]
    first = ddtrain(*run, "--steps", "17")
    assert first.returncode == 0, first.stderr
    refused = ddtrain(*run, "--steps", "30", "--resume")
    assert_one_clear_error(refused, "another learning-rate schedule than this run's: steps 17 -> 30",
                           "--resume-schedule-change")
    allowed = ddtrain(*run, "--steps", "30", "--resume", "--resume-schedule-change")
    assert allowed.returncode == 0, allowed.stderr
    assert "note: --resume-schedule-change: the learning-rate schedule changes at update 17" in allowed.stdout
