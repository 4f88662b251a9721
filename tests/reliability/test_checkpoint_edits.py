"""Hand-edited checkpoints give one clear message naming the file (issue 22: a header edited in place
was trusted, other edits gave cut-off internal errors such as torch.load's advice cut at 200 characters
or a KeyError)."""
import hashlib
import io
import json
import os
import pickle

import pytest
import torch

from ddtrain.config import TrainConfig
from ddtrain.errors import DDTrainError
from ddtrain.reliability import checkpoint
from ddtrain.training.build import load_and_build
from ddtrain.training.loop import fit

os.environ.pop("RANK", None)
SETTINGS = dict(model="mlp", data="digits", batch_size=64, lr=0.05, seed=3, epochs=1, steps=6, quiet=True,
                model_args={"hidden": (16,)})


def train(**overrides):
    config = TrainConfig.from_flat(**{**SETTINGS, **overrides})
    data, model = load_and_build(config)
    return fit(model, data, config)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ck") / "ck"
    train(checkpoint_dir=str(folder), checkpoint_every=3)
    return folder / "ckpt-00000006.pt"


def _split(path):
    data = path.read_bytes()
    end = data.index(b"\n", len(checkpoint.MAGIC))
    return json.loads(data[len(checkpoint.MAGIC):end]), data[end + 1:]


def _write(path, header, payload_bytes):
    path.write_bytes(checkpoint.MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload_bytes)


def test_a_header_edited_in_place_is_detected(written, tmp_path):
    """Was: the step 6 -> 9 edit (same length) was trusted; the resume claimed step 9."""
    path = tmp_path / written.name
    path.write_bytes(written.read_bytes().replace(b'"step": 6', b'"step": 9', 1))
    with pytest.raises(checkpoint.Damaged, match=r"^its header was changed after writing \(header checksum mismatch\)"):
        checkpoint.read(path)


def test_a_header_edited_to_another_length_is_not_called_truncated(written, tmp_path):
    path = tmp_path / written.name
    path.write_bytes(written.read_bytes().replace(b'"step": 6', b'"step": 600', 1))
    with pytest.raises(checkpoint.Damaged, match=r"^its header was changed after writing"):
        checkpoint.read_header(path)


def test_a_broken_header_line_names_the_json_problem(written, tmp_path):
    path = tmp_path / written.name
    path.write_bytes(written.read_bytes().replace(b'"step": 6', b'"step": 6,,', 1))
    with pytest.raises(checkpoint.Damaged, match=r"^its header line is not valid JSON \(Expecting property name "
                                                 r"enclosed in double quotes, at character \d+\): edited by hand"):
        checkpoint.read_header(path)


def test_header_fields_of_the_wrong_type_are_named(written, tmp_path):
    header, payload = _split(written)
    header["step"] = "six"
    del header["header_sha256"]  # as written before header checksums
    path = tmp_path / written.name
    _write(path, header, payload)
    with pytest.raises(checkpoint.Damaged, match=r"""^its header field 'step' is "six", not a non-negative integer$"""):
        checkpoint.read_header(path)


def test_torch_load_refusal_is_one_whole_sentence(tmp_path):
    """Was: 'refused by torch.load(weights_only=True): Weights only load failed. In PyTorch 2.6, we changed the
    default value of the `weights_only` argument in `torch.load` from `False` to `True`. Re-running `torch.l' (cut)."""
    class Evil:
        def __reduce__(self):
            return (os.getpid, ())
    evil = pickle.dumps({"w": Evil()}, protocol=2)
    header = {"step": 1, "payload_bytes": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}
    path = tmp_path / "ckpt-00000001.pt"
    _write(path, header, evil)
    with pytest.raises(checkpoint.Damaged) as info:
        checkpoint.read(path)
    message = str(info.value)
    assert message.startswith("refused by torch.load(weights_only=True): ") and "GLOBAL" in message
    assert message.endswith("(a checkpoint holds tensors and plain values only)") and "Re-running" not in message


def test_a_payload_without_the_training_state_is_refused_naming_the_file(written, tmp_path):
    """A re-signed payload that torch.load accepts but that lacks the ranks' parts. Was: KeyError: 'ranks'."""
    folder = tmp_path / "ck"
    folder.mkdir()
    buffer = io.BytesIO()
    torch.save({"format": 1, "step": 6, "shared": None}, buffer)
    data = buffer.getvalue()
    header, _ = _split(written)
    header.update(payload_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    header["header_sha256"] = checkpoint.header_checksum(header)
    _write(folder / written.name, header, data)
    with pytest.raises(DDTrainError, match=rf"^checkpoint {folder / written.name} cannot be resumed from: its payload "
                                           r"has no list of per-rank parts \('ranks'\) \(it was not written by "):
        train(checkpoint_dir=str(folder), resume=True, steps=9)
