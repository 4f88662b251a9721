"""``fit`` stopped by a real SIGTERM (in one process): a checkpoint at the stop step, and a resume equal to the run
that was never stopped, bit for bit, dropout RNG, cosine lr schedule and epoch metrics included; a signal before
the first step writes nothing; a second signal during the save leaves it whole; a full disk (a real 1 MB tmpfs)
during the preemption save keeps the previous checkpoint and says so once; a failed background write stops the
run at the next save. The multi-process runs are tests/integration/test_preemption.py."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess

import pytest
import torch

from ddtrain import TrainConfig, fit
from ddtrain.errors import DDTrainError
from ddtrain.models import build_model
from ddtrain.reliability import checkpoint
from helpers import tiny_data

STOP_AT = 17           # 12 steps an epoch: inside the second epoch


def _model():
    torch.manual_seed(0)
    return build_model("simple-cnn", num_classes=10, in_channels=1, input_size=(10, 10))   # with dropout


def _config(directory, **extra):
    settings = dict(model="simple-cnn", data="synthetic", epochs=3, batch_size=8, lr=0.1, momentum=0.9, seed=3,
                    val_fraction=0.0, quiet=True, lr_schedule="cosine", lr_warmup_steps=4)
    if directory is not None:   # no periodic checkpoint due in the run unless asked
        settings.update(checkpoint_dir=str(directory), checkpoint_every=1000)
    settings.update(extra)
    return TrainConfig.from_flat(**settings)


class SignalAt:
    """A callback sending real signals to this process at the end of step ``step`` (``times`` of them)."""

    def __init__(self, step: int, times: int = 1, hook: str = "on_step_end"):
        self.step, self.times = step, times
        if hook == "on_train_begin":
            self.on_train_begin = lambda state: self._send()

    def on_step_end(self, step, logs, state):
        if step == self.step:
            self._send()

    def _send(self):
        for _ in range(self.times):
            os.kill(os.getpid(), signal.SIGTERM)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _uninterrupted():
    model = _model()
    record = fit(model, tiny_data((1, 10, 10)), _config(None))
    return _state(model), [e["train_loss"] for e in record["epochs"]]


@pytest.fixture(scope="module")
def reference():
    return _uninterrupted()


def _leftovers(directory):
    return sorted(name for name in os.listdir(directory) if name.endswith((".tmp", ".damaged")))


@pytest.mark.parametrize("mode", ["background", "sync"])
def test_sigterm_saves_the_stop_step_and_the_resume_equals_the_uninterrupted_run(tmp_path, reference, mode):
    ck = tmp_path / "ck"
    sync = {"checkpoint_sync": True} if mode == "sync" else {}
    model = _model()
    before = signal.getsignal(signal.SIGTERM)
    record = fit(model, tiny_data((1, 10, 10)), _config(ck, save=str(tmp_path / "never.pt"), **sync),
                 callbacks=[SignalAt(STOP_AT)])
    assert signal.getsignal(signal.SIGTERM) == before          # fit put the handler back
    stopped = record["reliability"]["preempted"]
    assert stopped["step"] == STOP_AT and stopped["saved"] and stopped["signal"] == "SIGTERM"
    assert stopped["checkpoint"] == str(checkpoint.path_for(ck, STOP_AT))
    assert [p.name for _, p in checkpoint.listing(ck)] == [f"ckpt-{STOP_AT:08d}.pt"]   # no periodic one was due
    assert not (tmp_path / "never.pt").exists() and _leftovers(ck) == []
    assert len(record["reliability"]["checkpoint_stall_s"]) == 1

    resumed = _model()
    again = fit(resumed, tiny_data((1, 10, 10)), _config(ck, resume=True, **sync))
    assert "preempted" not in again["reliability"]
    params, losses = reference
    assert all(torch.equal(params[k], v) for k, v in _state(resumed).items())       # bit for bit
    assert [e["train_loss"] for e in again["epochs"]] == losses   # the epoch metrics, the stopped epoch's too


def test_a_signal_before_the_first_step_writes_nothing(tmp_path):
    ck = tmp_path / "ck"
    record = fit(_model(), tiny_data((1, 10, 10)), _config(ck), callbacks=[SignalAt(0, hook="on_train_begin")])
    stopped = record["reliability"]["preempted"]
    assert stopped == {**stopped, "step": 0, "saved": False, "checkpoint": None}
    assert checkpoint.listing(ck) == [] and _leftovers(ck) == [] and record["epochs"] == []


@pytest.mark.parametrize("mode", ["background", "sync"])
def test_a_second_signal_during_the_save_leaves_it_whole(tmp_path, monkeypatch, reference, mode):
    ck = tmp_path / "ck"
    sync = {"checkpoint_sync": True} if mode == "sync" else {}
    real_write, sent = checkpoint.write, []

    def write_while_signalled(path, header, payload):   # a real SIGTERM while the file is being written
        os.kill(os.getpid(), signal.SIGTERM)
        sent.append(path)
        return real_write(path, header, payload)
    monkeypatch.setattr(checkpoint, "write", write_while_signalled)
    record = fit(_model(), tiny_data((1, 10, 10)), _config(ck, **sync), callbacks=[SignalAt(STOP_AT)])
    assert sent == [checkpoint.path_for(ck, STOP_AT)] and record["reliability"]["preempted"]["step"] == STOP_AT
    header, _ = checkpoint.read(checkpoint.path_for(ck, STOP_AT))   # whole: its length and checksum verified
    assert header["step"] == STOP_AT and _leftovers(ck) == []
    monkeypatch.setattr(checkpoint, "write", real_write)
    resumed = _model()
    fit(resumed, tiny_data((1, 10, 10)), _config(ck, resume=True, **sync))
    assert all(torch.equal(reference[0][k], v) for k, v in _state(resumed).items())


@contextlib.contextmanager
def small_tmpfs(path, size: str):
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


class FillDisk:
    """After step ``step``'s checkpoint, fill what is left of the file system (a real ENOSPC for the next write)."""

    def __init__(self, step, directory):
        self.step, self.directory = step, directory

    def on_step_end(self, step, logs, state):
        if step == self.step:
            state.checkpointer.writer.wait()   # the write of step ``step`` is on disk first
            with open(self.directory / "filler", "wb") as f:
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * 65536)


def test_a_full_disk_during_the_preemption_save_keeps_the_previous_checkpoint_and_says_so_once(tmp_path):
    with small_tmpfs(tmp_path / "small", "1m") as disk:
        ck = disk / "ck"
        with pytest.raises(DDTrainError) as caught:
            fit(_model(), tiny_data((1, 10, 10)), _config(ck, checkpoint_every=10),
                callbacks=[FillDisk(10, disk), SignalAt(STOP_AT)])
        message = str(caught.value)
        assert message == (f"checkpoint {checkpoint.path_for(ck, STOP_AT)} could not be written: No space left on "
                           f"device [errno {errno.ENOSPC}]; the checkpoints already in {ck} are whole (newest: "
                           "ckpt-00000010.pt)"), message
        assert [p.name for _, p in checkpoint.listing(ck)] == ["ckpt-00000010.pt"] and _leftovers(ck) == []
        assert checkpoint.read(checkpoint.path_for(ck, 10))[0]["step"] == 10   # whole


def test_a_background_write_that_failed_stops_the_run_at_the_next_save(tmp_path, monkeypatch):
    ck, real_write, steps = tmp_path / "ck", checkpoint.write, []

    def failing_at_10(path, header, payload):
        if header["step"] == 10:
            raise OSError(errno.EIO, "Input/output error")
        return real_write(path, header, payload)
    monkeypatch.setattr(checkpoint, "write", failing_at_10)

    class Steps:
        def on_step_end(self, step, logs, state):
            steps.append(step)
    with pytest.raises(DDTrainError, match=r"ckpt-00000010.pt could not be written: Input/output error \[errno 5\]; "
                                           r"the checkpoints already in .* are whole \(newest: ckpt-00000005.pt\)"):
        fit(_model(), tiny_data((1, 10, 10)), _config(ck, checkpoint_every=5), callbacks=[Steps()])
    assert steps[-1] == 14   # training went on while step 10 was written; the save of step 15 reported it
    assert [p.name for _, p in checkpoint.listing(ck)] == ["ckpt-00000005.pt"] and _leftovers(ck) == []
