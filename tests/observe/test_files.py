"""Files the tool writes: strict JSON records, modes from the umask, atomic replacement."""
import json
import os
import stat

import numpy as np
import pytest
import torch

from ddtrain.observe import files


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"bare {constant} in a JSON record")
    return json.loads(text, parse_constant=refuse)


def test_records_write_null_for_nan_and_infinity(tmp_path):
    record = {"val_loss": float("nan"), "history": [1.5, float("inf"), -float("inf")],
              "per_rank": torch.tensor([0.25, float("nan")]), "nested": {"ok": 2, "bad": (float("nan"),)},
              "flag": True}
    path = files.write_json(tmp_path / "run.json", record)
    loaded = _strict(path.read_text())  # a strict parser accepts it
    assert loaded == {"val_loss": None, "history": [1.5, None, None], "per_rank": [0.25, None],
                      "nested": {"ok": 2, "bad": [None]}, "flag": True}


def test_records_take_numpy_values(tmp_path):
    record = {"numpy": np.float32("nan"), "array": np.array([1.0, np.inf]), "count": np.int64(3)}
    path = files.write_json(tmp_path / "run.json", record)
    assert _strict(path.read_text()) == {"numpy": None, "array": [1.0, None], "count": 3}


def test_strict_parse_helper_refuses_bare_nan():
    with pytest.raises(ValueError, match="bare NaN"):
        _strict('{"val_loss": NaN}')


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_outputs_respect_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        record = files.write_json(tmp_path / "run.json", {"a": 1})
        model = files.save_model(torch.nn.Linear(2, 2), tmp_path / "model.pt")
        text = files.atomic_write(tmp_path / "report.html", lambda tmp: open(tmp, "w").write("<p>"))
    finally:
        os.umask(old)
    for path in (record, model, text):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path


def test_umask_is_read_without_changing_it():
    old = os.umask(0o027)
    try:
        assert files.umask() == 0o027 and files.umask() == 0o027
    finally:
        os.umask(old)


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = files.write_json(tmp_path / "run.json", {"a": 1})

    def fail(tmp):
        open(tmp, "w").write("half")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        files.atomic_write(path, fail)
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary file left behind
