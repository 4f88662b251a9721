"""``ddtrain data pack`` and ``packed:DIR`` (issue 30): the same samples, checksums that refuse, packing that resumes."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from ddtrain.data import load_dataset
from ddtrain.data.imagefolder import load_imagefolder
from ddtrain.data.packed import MANIFEST, PROGRESS, PackOptions, load_packed, pack
from ddtrain.errors import DDTrainError
from helpers import ddtrain


@pytest.fixture
def folder(tmp_path):
    """PNG images (lossless, so packed raw pixels equal the decoded files), one JPEG, one unreadable file."""
    root = tmp_path / "src"
    rng = np.random.default_rng(0)
    for k, name in enumerate(("ant", "bee", "cow")):
        (root / name).mkdir(parents=True)
        for j in range(5):
            pixels = rng.integers(0, 256, (20 + 3 * j, 28 + 2 * k, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{j}.png")
    Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(root / "bee" / "photo.jpg", quality=90)
    (root / "cow" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    return root


def _pack(folder, out, **options):
    return pack(str(folder), str(out), PackOptions(**{"max_side": 0, **options}), workers=1)


def test_packed_raw_gives_the_folders_samples_classes_and_labels(folder, tmp_path):
    reported = []
    manifest = pack(str(folder), str(tmp_path / "p"), PackOptions(max_side=0), workers=1, report=reported.append)
    assert [p.file.rsplit("/", 1)[1] for p in reported] == ["broken.png"]
    assert manifest["skipped"][0]["file"].endswith("cow/broken.png")
    source = load_imagefolder(str(folder), size=16)
    packed = load_packed(str(tmp_path / "p"), size=16)
    keep = [i for i, f in enumerate(source.files) if f != "cow/broken.png"]
    assert packed.classes == source.classes == ["ant", "bee", "cow"]
    assert packed.labels.tolist() == source.labels[keep].tolist() and packed.files == [source.files[i] for i in keep]
    for j, i in enumerate(keep):   # the same pixels, so the same augmented sample from the same generator
        torch.manual_seed(j)
        a, la = source[i]
        torch.manual_seed(j)
        b, lb = packed[j]
        assert la == lb and torch.equal(a, b)
        assert torch.equal(source.eval_view()[i][0], packed.eval_view()[j][0])
    data = load_dataset(f"packed:{tmp_path / 'p'}", size=16, val_fraction=0.25)   # the split works as for any set
    assert len(data.train) + len(data.val) == len(packed) and not data.val.train and data.num_classes == 3


def test_max_side_scales_the_longer_side_and_jpeg_keeps_source_jpegs(folder, tmp_path):
    _pack(folder, tmp_path / "small", max_side=24)
    small = load_packed(str(tmp_path / "small"))
    assert max(max(h, w) for h, w in zip(small.height, small.width)) == 24
    i = small.files.index("bee/photo.jpg")                          # 40x30 -> 32x24 (the longer side 24)
    assert (small.height[i], small.width[i]) == (24, 18) and small.read(i).shape == (24, 18, 3)
    _pack(folder, tmp_path / "jpeg", encoding="jpeg")
    jpeg = load_packed(str(tmp_path / "jpeg"))
    i = jpeg.files.index("bee/photo.jpg")
    assert bytes(jpeg.read(i)) == (folder / "bee" / "photo.jpg").read_bytes()   # not re-encoded
    j = jpeg.files.index("ant/0.png")
    assert bytes(jpeg.read(j)[:3]) == b"\xff\xd8\xff"                             # a PNG became a JPEG
    assert jpeg.encoded and jpeg[j][0].shape == (3, 224, 224)


def test_a_damaged_shard_is_refused_naming_it(folder, tmp_path):
    _pack(folder, tmp_path / "p", shard_bytes=1 << 20)
    manifest = json.loads((tmp_path / "p" / MANIFEST).read_text())
    shard = tmp_path / "p" / manifest["shards"][0]["file"]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01                                      # one bit of one byte
    shard.write_bytes(bytes(raw))
    with pytest.raises(DDTrainError, match=rf"packed: shard {shard} fails its checksum .* refused"):
        load_packed(str(tmp_path / "p"))
    load_packed(str(tmp_path / "p"), verify="size")                 # sizes only: what verify=size promises
    shard.write_bytes(bytes(raw[:-1]))
    with pytest.raises(DDTrainError, match=rf"packed: shard {shard} has {len(raw) - 1} bytes; the manifest says"):
        load_packed(str(tmp_path / "p"), verify="size")


def test_an_interrupted_packing_looks_unfinished_and_resumes_to_the_same_set(folder, tmp_path, monkeypatch):
    import ddtrain.data.packed as packed_module
    _pack(folder, tmp_path / "whole", shard_bytes=1 << 20)          # one pass, for comparison
    small = PackOptions(max_side=0, shard_bytes=1 << 20)
    monkeypatch.setattr(packed_module, "HASH_CHUNK", 4096)
    closes = []
    real_close = packed_module._ShardWriter.close

    def crash_on_second(self, next_position):     # the first shard finishes; packing dies writing the second
        closes.append(next_position)
        if len(closes) == 2:
            raise KeyboardInterrupt
        return real_close(self, next_position)
    monkeypatch.setattr(packed_module._ShardWriter, "close", crash_on_second)
    monkeypatch.setattr(packed_module.PackOptions, "check", lambda self: None)
    tiny = PackOptions(max_side=0, shard_bytes=4000)                # a few samples a shard
    with pytest.raises(KeyboardInterrupt):
        pack(str(folder), str(tmp_path / "p"), tiny, workers=1)
    names = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert MANIFEST not in names and PROGRESS in names and not any(n.endswith(".partial") for n in names)
    with pytest.raises(DDTrainError, match="not a finished packed set: it has no manifest.json .*resume"):
        load_packed(str(tmp_path / "p"))
    with pytest.raises(DDTrainError, match=r"interrupted packing with other options \(shard_bytes differ\)"):
        pack(str(folder), str(tmp_path / "p"), small, workers=1)
    monkeypatch.setattr(packed_module._ShardWriter, "close", real_close)
    progress = []
    pack(str(folder), str(tmp_path / "p"), tiny, workers=1, progress=lambda done, total: progress.append(done))
    assert progress[0] == closes[0] > 0                              # resumed after the first shard, not from 0
    resumed, whole = load_packed(str(tmp_path / "p")), load_packed(str(tmp_path / "whole"))
    assert resumed.files == whole.files and resumed.labels.tolist() == whole.labels.tolist()
    assert all(np.array_equal(resumed.read(i), whole.read(i)) for i in range(len(whole)))
    assert not (tmp_path / "p" / PROGRESS).exists()


def test_pack_refuses_what_it_should(folder, tmp_path):
    _pack(folder, tmp_path / "p")
    with pytest.raises(DDTrainError, match="already holds a finished packed set"):
        _pack(folder, tmp_path / "p")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(DDTrainError, match="is not empty and holds no packing in progress"):
        _pack(folder, tmp_path / "other")
    with pytest.raises(DDTrainError, match="only image folders are packed"):
        pack(f"mnist:{folder}", str(tmp_path / "q"), PackOptions())
    with pytest.raises(DDTrainError, match="--encode 'png' is not one of: raw, jpeg"):
        pack(str(folder), str(tmp_path / "q"), PackOptions(encoding="png"))


def test_data_pack_command_and_training_from_the_packed_set(folder, tmp_path):
    out = tmp_path / "p"
    result = ddtrain("data", "pack", str(folder), str(out), "--max-side", "32", "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert "packed 16 images of 3 classes into 1 shard(s)" in result.stdout and "1 file(s) skipped" in result.stdout
    assert "broken.png: unreadable image" in result.stderr
    record = tmp_path / "run.json"
    result = ddtrain("train", "--model", "simple-cnn", "--data", f"packed:{out}", "--data-arg", "size=16",
                     "--batch-size", "4", "--steps", "3", "--out", str(record))
    assert result.returncode == 0, result.stderr
    run = json.loads(record.read_text())
    assert run["data_pipeline"]["decoder"] == "none (raw pixels)" and run["data_problems"]["files_skipped"] == 0
