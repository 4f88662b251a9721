"""Issue 30's bad input, trained through: corrupt, truncated, CMYK, grey, PNG-in-.jpg and empty images in one folder.

``ddtrain train`` on the CPU path (Pillow in two loader processes) runs both epochs to the end;
each unusable file is named once, and the record counts them: the empty one left out at the
scan, the corrupt and truncated ones skipped each time they are drawn (their place taken by
another image of the batch). CMYK, grey and PNG-in-.jpg files are images Pillow decodes: not
problems on this path.
"""
import json

import pytest

from test_image_pipeline import hostile_folder
from helpers import ddtrain


@pytest.mark.slow   # a whole launch with two loader processes: 8-13 s here
def test_training_runs_through_every_kind_of_bad_image(tmp_path):
    root = hostile_folder(tmp_path / "images")
    out = tmp_path / "run.json"
    result = ddtrain("train", "--model", "simple-cnn", "--data", f"imagefolder:{root}", "--data-arg", "size=16",
                     "--data-arg", "pipeline=cpu", "--loader-workers", "2", "--epochs", "2", "--batch-size", "5",
                     "--val-fraction", "0", "--lr", "0.01", "--out", str(out), timeout=180)
    assert result.returncode == 0, result.stderr
    text = result.stdout + result.stderr
    assert "Traceback" not in text and "Epoch 2/2" in text
    for name, why in (("corrupt.jpg", "unreadable image"), ("truncated.jpg", "unreadable image"),
                      ("empty.jpg", "empty file (0 bytes)")):
        lines = [line for line in text.splitlines() if f"/{name}: " in line]
        assert len(lines) == 1 and why in lines[0] and lines[0].endswith("(skipped)"), lines
    problems = json.loads(out.read_text())["data_problems"]
    assert problems["files_skipped"] == 3 and problems["files_decoded_on_cpu"] == 0
    times = {p["file"].rsplit("/", 1)[1]: p["times"] for p in problems["files"]}
    # 13 images in batches of 5, 5, 3: every one drawn once per epoch; the empty one counted once, at the scan
    assert times == {"corrupt.jpg": 2, "truncated.jpg": 2, "empty.jpg": 1}
    assert problems["samples_skipped"] == 5
