"""A checkpoint's header stays small, is written only if it can be read back, and every header that cannot be
trusted is named as damaged in one sentence (issue 32).

Was: the per-epoch history lived in the header, so a run of 5,000 one-step epochs wrote headers longer than
the reader's 1 MiB line and every new checkpoint read as "truncated inside its header" (a resume went back
2,500 epochs); a whole checkpoint with a 2 MB header was called damaged; a header whose checksum field was
deleted read as whole (an edited step was trusted); a header nested 100,000 deep or with fields of the
wrong types was a traceback; a FIFO named like the newest checkpoint blocked the launcher for ever.
"""
import json
import os
import shutil
import threading

import pytest
import torch

from helpers import ddtrain
from ddtrain import TrainConfig, fit
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.errors import DDTrainError
from ddtrain.models import build_model
from ddtrain.reliability import checkpoint

os.environ.pop("RANK", None)  # trains in this process, a world of one


def short_epochs(folder, epochs: int, **extra):
    """A run of ``epochs`` one-step epochs (32 samples, batch 32) checkpointing at every epoch's end: its record."""
    g = torch.Generator().manual_seed(1)
    data = Data("synthetic", ArrayDataset(torch.randn(32, 1, 4, 4, generator=g), torch.randint(0, 3, (32,), generator=g),
                                          num_classes=3), None, 3, (1, 4, 4), "classification")
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=3, in_channels=1, input_size=(4, 4), hidden=(8,))
    config = TrainConfig.from_flat(model="mlp", data="synthetic", epochs=epochs, batch_size=32, lr=0.05, seed=3,
                                   val_fraction=0.0, quiet=True, checkpoint_dir=str(folder), **extra)
    return fit(model, data, config)


def header_bytes(path) -> int:
    data = path.read_bytes()
    return data.index(b"\n", len(checkpoint.MAGIC)) - len(checkpoint.MAGIC)


def split(path):
    data = path.read_bytes()
    end = data.index(b"\n", len(checkpoint.MAGIC))
    return json.loads(data[len(checkpoint.MAGIC):end]), data[end + 1:]


def rewrite(path, header: dict, payload_bytes: bytes, *, sign: bool = True) -> None:
    """Write ``path`` with this header (re-signed when ``sign``, as a forger would) and payload bytes."""
    header = {k: v for k, v in header.items() if k != "header_sha256"}
    if sign:
        header["header_sha256"] = checkpoint.header_checksum(header)
    path.write_bytes(checkpoint.MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload_bytes)


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """40 one-step epochs, a checkpoint at the end of each (the 3 newest kept)."""
    folder = tmp_path_factory.mktemp("epochs") / "ck"
    return folder, short_epochs(folder, 40)


def test_the_header_does_not_grow_with_the_epochs_and_a_resume_keeps_the_history(long_run, tmp_path):
    """Was: every epoch added ~300 bytes of history to the header (5,000 epochs: past the reader's limit)."""
    folder, record = long_run
    newest = checkpoint.path_for(folder, 40)
    early = tmp_path / "early"
    short_epochs(early, 2)
    assert abs(header_bytes(newest) - header_bytes(checkpoint.path_for(early, 2))) < 64   # step numbers' digits
    header, payload = checkpoint.read(newest)
    assert "epochs_done" not in header and header["format"] == checkpoint.FORMAT == 2
    assert len(payload["epochs_done"]) == 39 and payload["epochs_done"] == json.loads(json.dumps(record["epochs"][:39]))
    # the resumed run's record has every epoch, the 40 before the checkpoint's end included
    again = short_epochs(shutil.copytree(folder, tmp_path / "again"), 45, resume=True)
    assert [e["train_loss"] for e in again["epochs"][:40]] == [e["train_loss"] for e in record["epochs"]]
    assert len(again["epochs"]) == 45


def test_a_format_1_checkpoint_with_its_history_in_the_header_still_resumes(long_run, tmp_path):
    """Checkpoints written before format 2 (history in the header, checksummed) resume as before."""
    folder, record = long_run
    old = shutil.copytree(folder, tmp_path / "old")
    path = checkpoint.path_for(old, 40)
    header, payload = checkpoint.read(path)
    history = payload.pop("epochs_done")
    import io
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    raw = buffer.getvalue()
    import hashlib
    rewrite(path, {**header, "format": 1, "epochs_done": history, "payload_bytes": len(raw),
                   "sha256": hashlib.sha256(raw).hexdigest()}, raw)
    again = short_epochs(old, 41, resume=True)
    assert again["reliability"]["resumed_from"]["step"] == 40
    assert [e["train_loss"] for e in again["epochs"][:40]] == [e["train_loss"] for e in record["epochs"]]


def test_a_whole_checkpoint_with_a_2_mb_header_is_read(tmp_path):
    """Was: 'DAMAGED: truncated inside its header' (the reader stopped at 1 MiB)."""
    path = checkpoint.write(checkpoint.path_for(tmp_path, 1), {"step": 1, "note": "x" * 2_000_000},
                            {"w": torch.ones(2)})
    header, payload = checkpoint.read(path)
    assert len(header["note"]) == 2_000_000 and torch.equal(payload["w"], torch.ones(2))


def test_the_writer_never_writes_a_header_the_reader_refuses(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "HEADER_LIMIT", 4096)
    with pytest.raises(DDTrainError, match=r"was not written: its header would be [\d,]+ bytes, more than the 4,096 "
                                           r"a checkpoint header may have \(largest fields: note"):
        checkpoint.write(checkpoint.path_for(tmp_path, 1), {"step": 1, "note": "x" * 5000}, {"w": torch.ones(2)})
    assert os.listdir(tmp_path) == []
    # a longer header line than the limit (another program's file) is named as such, not as "truncated"
    path = tmp_path / "ckpt-00000002.pt"
    path.write_bytes(checkpoint.MAGIC + b"{" + b" " * 5000 + b"}\n")
    with pytest.raises(checkpoint.Damaged, match=r"^its header line is longer than 4,096 bytes"):
        checkpoint.read_header(path)


@pytest.fixture
def written(tmp_path):
    """A 2-epoch run's newest checkpoint (step 2), alone in its directory."""
    folder = tmp_path / "ck"
    short_epochs(folder, 2)
    checkpoint.path_for(folder, 1).unlink()
    return checkpoint.path_for(folder, 2)


def test_a_header_whose_checksum_was_deleted_is_damaged(written):
    """Was: step 2 edited to 1 with header_sha256 deleted read as whole, and the resume went on from step 1."""
    header, payload = split(written)
    rewrite(written, {**header, "step": 1}, payload, sign=False)
    with pytest.raises(checkpoint.Damaged, match=r"^its header has no checksum \(header_sha256\), which every "
                                                 r"checkpoint of its format has: the field was deleted"):
        checkpoint.read_header(written)


def test_a_format_1_header_without_checksum_is_read_only_if_its_step_is_the_payloads(written):
    """Format 1 files written before header checksums have none: still read, but an edited step is caught (the
    payload, under its SHA-256, holds the step too)."""
    header, payload = split(written)
    rewrite(written, {**header, "format": 1}, payload, sign=False)
    got, _ = checkpoint.read(written)
    assert got["step"] == 2 and not checkpoint.verified(got)
    rewrite(written, {**header, "format": 1, "step": 1}, payload, sign=False)
    with pytest.raises(checkpoint.Damaged, match=r"^its header says step 1 but its payload holds the state after "
                                                 r"step 2, and the header has no checksum"):
        checkpoint.read(written)


@pytest.mark.parametrize("edit, message", [
    ({"elastic": {"workers": "two"}}, r"^its header field elastic.workers is \"two\", not a non-negative integer$"),
    ({"elastic": {"worker_counts": 3}}, r"^its header field elastic.worker_counts is 3, not a list of"),
    ({"run": {"lineage": ["x"]}}, r"^its header field run.lineage is \[\"x\"\], not a string or null$"),
    ({"strategy": 5}, r"^its header field 'strategy' is 5, not a string$"),
    ({"schedule": []}, r"^its header field 'schedule' is \[\], not an object$"),
    ({"fingerprint": {"parameter_shapes": [1, 2]}}, r"^its header field fingerprint.parameter_shapes is \[1, 2\]"),
    ({"format": "2"}, r"^its header field 'format' is \"2\", not a positive integer$"),
    ({"format": 7}, r"^written by a newer ddtrain \(checkpoint format 7; this one reads formats 1 to 2\)"),
])
def test_header_fields_of_the_wrong_type_are_damaged_not_a_traceback(written, edit, message):
    header, payload = split(written)
    rewrite(written, {**header, **edit}, payload)   # re-signed: only the types are wrong
    with pytest.raises(checkpoint.Damaged, match=message):
        checkpoint.read_header(written)


def test_a_header_nested_100000_deep_is_damaged_not_a_recursion_error(written):
    header, payload = split(written)
    line = json.dumps(header)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    written.write_bytes(checkpoint.MAGIC + line.encode() + b"\n" + payload)
    with pytest.raises(checkpoint.Damaged, match=r"^its header line is JSON nested too deeply"):
        checkpoint.read_header(written)


def test_a_malformed_schedule_section_is_one_message(written, tmp_path):
    """A schedule of the right type whose values are not (re-signed) is refused at resume naming the file."""
    header, payload = split(written)
    plan = {**header["schedule"]["plan"], "total": "many"}
    rewrite(written, {**header, "schedule": {**header["schedule"], "plan": plan}}, payload)
    with pytest.raises(DDTrainError, match=r"cannot be resumed from: its header's 'schedule' section is not one "
                                           r"ddtrain writes"):
        short_epochs(written.parent, 4, resume=True, lr_schedule="cosine")


def within(seconds: float, call):
    """``call()``'s result, or a failure if it has not returned within ``seconds`` (a blocked open of a FIFO)."""
    out = {}
    worker = threading.Thread(target=lambda: out.update(result=_outcome(call)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still blocked after {seconds} s"
    return out["result"]


def _outcome(call):
    try:
        return call()
    except Exception as exc:   # returned, to be checked on the test's thread
        return exc


def test_a_fifo_named_like_the_newest_checkpoint_is_damaged_not_a_hang(written):
    """Was: opening it blocked for ever (the launcher of a --resume hung)."""
    fifo = checkpoint.path_for(written.parent, 9)
    os.mkfifo(fifo)
    got = within(30, lambda: checkpoint.read_header(fifo))
    assert isinstance(got, checkpoint.Damaged), got
    assert str(got) == "not a checkpoint: it is a FIFO (named pipe), not a regular file"
    warnings = []
    path, header, _ = within(30, lambda: checkpoint.newest(written.parent, warn=warnings.append, quarantine=True))
    assert path == written and warnings == [f"checkpoint {fifo} is damaged (not a checkpoint: it is a FIFO (named "
                                            "pipe), not a regular file); trying the previous one"]


@pytest.mark.slow  # two real runs of the command
def test_the_command_resumes_past_a_fifo_in_one_line_each(tmp_path):
    """``ddtrain train --resume`` with a FIFO as the newest checkpoint: a warning naming it, then the run goes on."""
    folder = tmp_path / "ck"
    first = ddtrain("train", "--model", "mlp", "--data", "digits", "--steps", "4", "--checkpoint-every", "2",
                    "--checkpoint-dir", str(folder), "--quiet", "--model-arg", "hidden=8", timeout=180)
    assert first.returncode == 0, first.stderr
    os.mkfifo(checkpoint.path_for(folder, 99))
    again = ddtrain("train", "--model", "mlp", "--data", "digits", "--steps", "6", "--checkpoint-every", "2",
                    "--checkpoint-dir", str(folder), "--quiet", "--model-arg", "hidden=8", "--resume", timeout=180)
    assert again.returncode == 0, again.stderr
    assert "ckpt-00000099.pt is damaged (not a checkpoint: it is a FIFO" in again.stderr
    assert "Traceback" not in again.stderr
