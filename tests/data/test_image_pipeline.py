"""The batched image path (issue 30): order and sharding kept, bad files routed, one batch prepared ahead.

The GPU decoder (torchvision's nvjpeg) does not exist on these machines; its stage is tested
with a stand-in that behaves as the documented call does (a list of uint8 byte tensors in,
CHW uint8 images out, one exception for the whole batch if one image fails), so what is tested
is ddtrain's routing: which file goes where, the one-by-one retry, the Pillow fallback, the
records. The real nvjpeg runs in benchmarks/gpu_input_pipeline.py on the GPU machine.
"""
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from ddtrain.data.decode import ON_CPU, SKIPPED, decode_pillow, jpeg_components, kind
from ddtrain.data.imagefolder import load_imagefolder
from ddtrain.data.images import ImageDataset, ProblemLog
from ddtrain.data.loading import ShardLoader
from ddtrain.data.pipeline import BatchPipeline, prefetched
from ddtrain.data.sharding import ShardSampler
from ddtrain.errors import DDTrainError


def photo(height, width, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, np.full_like(x, 40 * (seed % 6))], -1)
    return np.clip(base + rng.normal(0, 10, (height, width, 3)), 0, 255).astype(np.uint8)


def hostile_folder(root):
    """Two classes of good JPEGs, and one of each kind of bad or unusual file among them."""
    for k, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for j in range(4):
            Image.fromarray(photo(30 + 3 * j, 40 + 5 * k, 10 * k + j)).save(root / name / f"{name}_{j}.jpg", quality=95)
    cat, dog = root / "cat", root / "dog"
    (cat / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG" + bytes(range(256)) * 4)
    Image.fromarray(photo(64, 64, 99)).save(cat / "truncated.jpg", quality=90)
    (cat / "truncated.jpg").write_bytes((cat / "truncated.jpg").read_bytes()[:700])
    Image.fromarray(photo(32, 48, 7)).convert("CMYK").save(dog / "cmyk.jpg", quality=95)
    Image.fromarray(photo(32, 48, 8)).convert("L").save(dog / "grey.jpg", quality=95)
    Image.fromarray(photo(36, 36, 9)).save(dog / "png_named.jpg", format="PNG")
    (dog / "empty.jpg").write_bytes(b"")
    return root


def test_the_files_are_what_the_test_means():
    """The hostile folder's files sniff as intended (so the routing tests below test what they say)."""
    import io
    cmyk, grey, png = io.BytesIO(), io.BytesIO(), io.BytesIO()
    Image.new("CMYK", (8, 8)).save(cmyk, format="JPEG")
    Image.new("L", (8, 8)).save(grey, format="JPEG")
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    assert jpeg_components(cmyk.getvalue()) == 4 and kind(cmyk.getvalue()) == "jpeg-cmyk"
    assert jpeg_components(grey.getvalue()) == 1 and kind(grey.getvalue()) == "jpeg"
    assert kind(png.getvalue()) == "png" and kind(b"") == "empty" and kind(b"GIF89a") == "other"
    assert decode_pillow(cmyk.getvalue()).shape == (8, 8, 3) and decode_pillow(grey.getvalue()).shape == (8, 8, 3)


class FakeNvjpeg:
    """Stands in for torchvision.io.decode_jpeg(list, device=...): all or nothing per call, like the real one."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def calls_for(ds, order) -> int:
        """Images a decoder is given for one batch when it takes all its JPEGs (then one by one after a failure)."""
        decoder = FakeNvjpeg()
        list(BatchPipeline(ds, torch.device("cpu"), threads=2, decoder=decoder).batches([order]))
        return sum(decoder.calls)

    def __call__(self, tensors, device):
        self.calls.append(len(tensors))
        out = []
        for t in tensors:
            try:
                pixels = decode_pillow(t.numpy())
            except Exception as exc:
                raise RuntimeError(f"Error while decoding JPEG images: {exc}") from None
            out.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1).to(device))
        return out


def _eval_set(root, **kw):
    return load_imagefolder(str(root), size=24, augment=False, normalize=False, pipeline="cpu", **kw)


def test_gpu_decode_stage_routes_every_kind_of_file(tmp_path):
    ds = _eval_set(hostile_folder(tmp_path))
    assert [p.file for p in ds.scan_problems] == [str(tmp_path / "dog" / "empty.jpg")]    # left out at the scan
    decoder = FakeNvjpeg()
    pipe = BatchPipeline(ds, torch.device("cpu"), threads=2, decoder=decoder)
    order = torch.arange(len(ds))
    got = list(pipe.batches([order]))
    (x, y, problems), = got
    where = {p.file.split("/")[-1]: (p.action, p.reason) for p in problems}
    assert where["corrupt.jpg"][0] == SKIPPED and "unreadable image" in where["corrupt.jpg"][1]
    assert where["truncated.jpg"][0] == SKIPPED
    assert where["cmyk.jpg"] == (ON_CPU, "a CMYK JPEG (nvjpeg's RGB output does not convert it)")
    assert where["png_named.jpg"] == (ON_CPU, "not a JPEG (PNG)")
    assert set(where) == {"corrupt.jpg", "truncated.jpg", "cmyk.jpg", "png_named.jpg"}   # grey: nvjpeg's own
    # the batched call failed on the truncated file; every JPEG was then tried alone
    jpegs = sum(kind(ds.read(i)) == "jpeg" for i in range(len(ds)))
    assert decoder.calls == [jpegs] + [1] * jpegs
    # every position holds a real image: the decoded ones as the CPU path makes them, the skipped filled
    cpu = torch.stack([ds[i][0] for i in range(len(ds)) if "corrupt" not in ds.files[i] and "trunc" not in ds.files[i]])
    kept = [i for i in range(len(ds)) if "corrupt" not in ds.files[i] and "trunc" not in ds.files[i]]
    assert (x[kept] - cpu).abs().mean() < 1.5 / 255 and (x[kept] - cpu).abs().max() < 12 / 255
    assert torch.equal(y[kept], torch.as_tensor(ds.labels[kept]))
    for i in set(range(len(ds))) - set(kept):    # a skipped sample's place: another image and its label
        twin = [k for k in kept if torch.equal(x[k], x[i])]
        assert twin and y[i] == y[twin[0]]


def test_without_a_gpu_decoder_pillow_decodes_all_and_only_bad_files_are_reported(tmp_path):
    ds = _eval_set(hostile_folder(tmp_path))
    (x, y, problems), = BatchPipeline(ds, torch.device("cpu"), threads=2).batches([torch.arange(len(ds))])
    assert sorted(p.file.split("/")[-1] for p in problems) == ["corrupt.jpg", "truncated.jpg"]
    assert x.shape == (len(ds), 3, 24, 24) and torch.isfinite(x).all()


def test_pipeline_keeps_the_samplers_order_and_shards(tmp_path, monkeypatch):
    """Three ranks' batches through the batched path: exactly the sampler's samples, in its order."""
    root = tmp_path / "set"
    for k in range(3):
        (root / f"c{k}").mkdir(parents=True)
        for j in range(7):   # each image's pixels say which file it is: colour (k, j)
            Image.new("RGB", (20 + j, 16), (60 * k, 30 * j, 100)).save(root / f"c{k}" / f"{j}.png")
    ds = _eval_set(root)
    monkeypatch.setattr(ImageDataset, "batch_pipeline",
                        lambda self, device, threads: BatchPipeline(self, device, threads=2))
    seen = []
    for rank in range(3):
        sampler = ShardSampler(len(ds), rank=rank, world_size=3, seed=4)
        sampler.set_epoch(2)
        loader = ShardLoader(ds, sampler, 3, torch.device("cpu"))
        assert loader.pipeline is not None and loader.describe()["decoder"] == "Pillow, in threads"
        loader.set_epoch(2)
        got = [(x, y) for x, y in loader]
        idx = sampler.indices()
        expect = [idx[s * 3:(s + 1) * 3] for s in range(loader.steps)]
        for (x, y), want in zip(got, expect):
            assert y.tolist() == ds.labels[want.numpy()].tolist()
            colour = (x.mean((2, 3)) * 255).round()
            names = [ds.files[i] for i in want.tolist()]
            assert colour[:, 1].tolist() == [30.0 * int(n.split("/")[1][0]) for n in names]
        seen += idx.tolist()
    assert sorted(seen) == list(range(len(ds)))   # 21 samples over 3 ranks: each exactly once


def test_prefetched_keeps_order_raises_at_the_item_and_stops_early():
    made = []

    def make(i):
        made.append(i)
        if i == 5:
            raise ValueError("item 5 is bad")
        return torch.tensor([i])

    out = []
    with pytest.raises(ValueError, match="item 5 is bad"):
        for t in prefetched(range(10), make, torch.device("cpu"), depth=2):
            out.append(int(t))
    assert out == [0, 1, 2, 3, 4]
    # a consumer that stops early: the producer stops too, at most depth + 1 items ahead
    before = {t.name for t in threading.enumerate()}
    made.clear()
    gen = prefetched(range(1000), lambda i: made.append(i) or i, torch.device("cpu"), depth=2)
    assert [next(gen) for _ in range(3)] == [0, 1, 2]
    gen.close()
    time.sleep(0.3)
    assert len(made) <= 3 + 2 + 1 and "ddtrain-batches" not in {t.name for t in threading.enumerate()} - before


def test_problem_log_reports_each_file_once_and_counts_every_use():
    from ddtrain.data.decode import Problem
    lines = []
    log = ProblemLog(report=lambda p: lines.append(p.line()))
    bad, odd = Problem("a.jpg", "unreadable image (x)", SKIPPED), Problem("b.jpg", "not a JPEG (PNG)", ON_CPU)
    log.add([bad, odd])
    log.add([bad])
    assert lines == ["a.jpg: unreadable image (x) (skipped)", "b.jpg: not a JPEG (PNG) (decoded on the CPU)"]
    assert {k: v for k, v in log.as_dict().items() if k != "files"} == {
        "files_skipped": 1, "samples_skipped": 2, "files_decoded_on_cpu": 1, "samples_decoded_on_cpu": 1,
        "files_not_listed": 0}


@pytest.mark.parametrize("readers", [0, 2])
def test_loader_processes_read_the_same_batches_as_threads(tmp_path, readers):
    """With loader processes each batch is read in one of them (one shared tensor a batch); the batches,
    the bad files' reports and their order are those of the in-process path (readers=0)."""
    ds = _eval_set(hostile_folder(tmp_path))
    order = [torch.tensor([5, 0, 9, 3]), torch.arange(len(ds)), torch.tensor([11, 2])]
    ref = list(BatchPipeline(ds, torch.device("cpu"), threads=2).batches(order))
    got = list(BatchPipeline(ds, torch.device("cpu"), threads=2, readers=readers).batches(order))
    assert len(got) == len(ref) == 3
    for (x, y, problems), (rx, ry, rproblems) in zip(got, ref):
        assert torch.equal(y, ry) and x.shape == rx.shape
        assert sorted(p.line() for p in problems) == sorted(p.line() for p in rproblems)
        assert torch.isfinite(x).all()


def test_a_file_that_cannot_be_read_in_a_loader_process_is_skipped_and_named(tmp_path):
    from ddtrain.data.pipeline import read_batch
    ds = _eval_set(hostile_folder(tmp_path))
    gone = next(i for i in range(len(ds)) if ds.files[i].endswith("dog_1.jpg"))
    (tmp_path / ds.files[gone]).unlink()
    read = read_batch(ds, [0, gone, 1])
    items = read.items(ds)
    assert items[1].action == SKIPPED and "dog_1.jpg" in items[1].file and "cannot be read" in items[1].reason
    assert bytes(items[0][:3]) == b"\xff\xd8\xff" and read.flat.numel() == sum(read.sizes)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_loader_processes_decoding_part_of_each_batch_give_the_same_batches(tmp_path, fraction):
    """``cpu_decode``: the loader processes decode the first round(fraction x n) plain JPEGs of a batch (Pillow) and
    the rest go to the GPU decoder (here the stand-in, Pillow too): the batches, labels and every bad file's report
    are those of the path where the decoder takes them all, and the decoder is given only the others."""
    from ddtrain.data.pipeline import read_batch
    ds = _eval_set(hostile_folder(tmp_path))
    order = [torch.tensor([5, 0, 9, 3]), torch.arange(len(ds)), torch.tensor([11, 2])]
    ref = list(BatchPipeline(ds, torch.device("cpu"), threads=2, decoder=FakeNvjpeg()).batches(order))
    decoder = FakeNvjpeg()
    pipe = BatchPipeline(ds, torch.device("cpu"), threads=2, decoder=decoder, readers=2, cpu_decode=fraction)
    got = list(pipe.batches(order))
    assert pipe.describe()["cpu_decode"] == fraction
    for (x, y, problems), (rx, ry, rproblems) in zip(got, ref, strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)
        assert sorted(p.line() for p in problems) == sorted(p.line() for p in rproblems)
    # what one loader process keeps as pixels: the first round(f x n) plain JPEGs, never a bad or unusual file
    idx = order[1].tolist()
    read = read_batch(ds, idx, fraction)
    decoded = [k for k, shape in enumerate(read.shapes) if shape is not None]
    good = [k for k, i in enumerate(idx) if kind(ds.read(i)) == "jpeg" and not any(
        bad in ds.files[i] for bad in ("corrupt", "trunc"))]              # plain JPEGs Pillow can decode
    assert decoded == good[:round(fraction * len(idx))]
    on_cpu = read.pixels_on(torch.device("cpu"))
    for k in decoded:
        assert torch.equal(on_cpu[k], torch.from_numpy(ds.pixels(idx[k]).copy()).permute(2, 0, 1))
    # the GPU decoder was given only the JPEGs the loader processes left: each batch's, then one by one
    assert sum(decoder.calls) < sum(FakeNvjpeg.calls_for(ds, o) for o in order)


def test_cpu_decode_is_a_fraction_named_when_wrong(tmp_path):
    root = hostile_folder(tmp_path)
    assert load_imagefolder(str(root), cpu_decode="0.25").cpu_decode == 0.25
    for bad, why in (("1.5", "must be from 0 to 1"), ("half", "is not a number")):
        with pytest.raises(DDTrainError, match=f"imagefolder: option cpu_decode={bad!r} {why}"):
            load_imagefolder(str(root), cpu_decode=bad)
