import gzip
import hashlib
import struct

import numpy as np
import pytest
import torch

from ddtrain.data import load_dataset
from ddtrain.data.sharding import ShardSampler, contiguous_sizes
from ddtrain.errors import DDTrainError


def test_digits_ship_with_the_install_and_fit_simple_cnn():
    data = load_dataset("digits", val_fraction=0.2)
    assert data.sample_shape == (1, 28, 28) and data.num_classes == 10
    assert len(data.train) + len(data.val) == 1797
    x, y = data.train[0]
    assert 0.0 <= x.min() and x.max() <= 1.0 and 0 <= int(y) <= 9


def test_real_mnist_test_set_matches_its_checksums(mnist_dir):
    for line in (mnist_dir / "MD5SUMS").read_text().split("\n"):
        if line.strip():
            digest, name = line.split()
            assert hashlib.md5((mnist_dir / name).read_bytes()).hexdigest() == digest
    data = load_dataset(f"mnist:{mnist_dir}", val_fraction=0.0)
    assert len(data.train) == 10_000 and data.sample_shape == (1, 28, 28)
    counts = torch.bincount(data.train.y, minlength=10)
    assert counts.sum() == 10_000 and counts.min() > 800  # every digit present


def _write_idx(path, magic, array, truncate=0):
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.write_bytes(raw[: len(raw) - truncate])


def test_mnist_format_errors_name_the_file(tmp_path):
    images = np.zeros((5, 28, 28))
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", 2051, images, truncate=10)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", 2049, np.zeros(5))
    with pytest.raises(DDTrainError, match="t10k-images-idx3-ubyte.*truncated"):
        load_dataset(f"mnist:{tmp_path}")
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", 1234, images)
    with pytest.raises(DDTrainError, match="magic number 1234"):
        load_dataset(f"mnist:{tmp_path}")
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", 2051, images)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", 2049, np.zeros(4))
    with pytest.raises(DDTrainError, match="5 images but .* 4 labels"):
        load_dataset(f"mnist:{tmp_path}")
    with pytest.raises(DDTrainError, match="does not exist"):
        load_dataset(f"mnist:{tmp_path / 'nope'}")


def test_mnist_reads_gzipped_idx(tmp_path):
    images = np.random.default_rng(0).integers(0, 255, (6, 28, 28))
    _write_idx(tmp_path / "raw", 2051, images)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress((tmp_path / "raw").read_bytes()))
    _write_idx(tmp_path / "train-labels-idx1-ubyte", 2049, np.arange(6))
    data = load_dataset(f"mnist:{tmp_path}", val_fraction=0.0)
    assert torch.allclose(data.train.x[:, 0], torch.from_numpy(images / 255.0).float())


def test_npz_in_the_documents_layout(tmp_path):
    x = np.random.default_rng(0).random((20, 28, 28, 1))          # channels-last, float64
    y = np.eye(10)[np.arange(20) % 10]                               # one-hot
    np.savez(tmp_path / "d.npz", x=x, y=y)
    data = load_dataset(f"npz:{tmp_path / 'd.npz'}", val_fraction=0.0)
    assert data.sample_shape == (1, 28, 28) and data.num_classes == 10
    assert data.train.y.tolist() == list(np.arange(20) % 10)
    np.savez(tmp_path / "bad.npz", x=x)
    with pytest.raises(DDTrainError, match="missing array"):
        load_dataset(f"npz:{tmp_path / 'bad.npz'}")


def test_unknown_format_lists_the_valid_ones():
    with pytest.raises(DDTrainError, match="valid: .*digits.*mnist:DIR"):
        load_dataset("imagenette:/x")


@pytest.mark.parametrize("n,world,expected", [(145, 4, [36, 36, 36, 37]), (2175, 4, [543, 543, 543, 546]),
                                              (2175, 8, [271] * 7 + [278])])
def test_contiguous_chunks_of_document_000_tables_6_1_and_6_2(n, world, expected):
    assert contiguous_sizes(n, world) == expected
    shards = [ShardSampler(n, rank=r, world_size=world, policy="contiguous", shuffle=False).indices()
              for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank runs the same number of steps
    assert set(torch.cat(shards).tolist()) == set(range(n))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_balanced_shards_are_disjoint_equal_and_reshuffled(world):
    n = 103
    epoch = [[ShardSampler(n, rank=r, world_size=world, seed=5).indices() for r in range(world)]]
    samplers = [ShardSampler(n, rank=r, world_size=world, seed=5) for r in range(world)]
    for s in samplers:
        s.set_epoch(1)
    epoch.append([s.indices() for s in samplers])
    for shards in epoch:
        flat = torch.cat(shards).tolist()
        assert len(flat) == len(set(flat)) == (n // world) * world
        assert len({len(s) for s in shards}) == 1
    assert not torch.equal(epoch[0][0], epoch[1][0])


def test_prefetching_thread_yields_the_same_batches_and_stops_early():
    import threading

    from ddtrain.data.arrays import ArrayDataset
    from ddtrain.data.loading import ShardLoader
    ds = ArrayDataset(torch.randn(100, 1, 4, 4), torch.arange(100), num_classes=100)
    loader = ShardLoader(ds, ShardSampler(100, rank=0, world_size=1, seed=3), 16, torch.device("cpu"))
    direct = [y for _, y in loader]
    prefetched = [y for _, y in loader._prefetched(torch.device("cpu"), pin=False)]
    assert len(direct) == len(prefetched) == 7 and all(torch.equal(a, b) for a, b in zip(direct, prefetched))
    it = loader._prefetched(torch.device("cpu"), pin=False)
    next(it)
    it.close()  # a run that stops mid-epoch (--steps) must not leave the thread blocked
    import time
    time.sleep(0.5)
    assert not any(t.name == "ddtrain-prefetch" for t in threading.enumerate())


def test_a_lazy_dataset_materialised_on_its_device_equals_its_batches():
    from ddtrain.data.arrays import ArrayDataset
    from ddtrain.data.loading import gather, to_device
    from ddtrain.data.synthetic import load_synthetic
    for name in ("cifar10", "hcp"):
        lazy = load_synthetic(name, samples=40, size=16, lazy=True)
        part = lazy.select(torch.arange(3, 40, 2))  # a split keeps its index into the full set
        for channels_last in (False, True):
            whole = part.materialise(channels_last=channels_last, chunk_bytes=5000)  # several chunks
            assert isinstance(whole, ArrayDataset) and len(whole) == len(part) == 19
            idx = torch.tensor([0, 7, 18, 2])
            for a, b in zip(whole.batch(idx), part.batch(idx)):
                assert torch.equal(a, b)
            assert whole.x.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert part.nbytes() == whole.x.numel() * 4 + whole.y.numel() * whole.y.element_size()
        assert isinstance(to_device(part, torch.device("cpu")), ArrayDataset)
        x, y = gather(whole, idx, pin=False)
        assert torch.equal(x, whole.x[idx]) and torch.equal(y, whole.y[idx])
