"""Hostile and quirky data (issue 22): each refused at load time, naming the file and the problem.

Loading happens in the launching process before any worker starts (``training/build.py``'s
``validate``), so each of these becomes one clear line instead of a silent wrong result, a
hang or an error mid-epoch. Inputs are built here in ``tmp_path``.
"""
import gzip
import os
import shutil
import socket
import stat
import time

import numpy as np
import pytest
import torch

from ddtrain.data import load_dataset
from ddtrain.data.imagefolder import load_imagefolder
from ddtrain.data.mnist import load_mnist
from ddtrain.data.npz import load_npz
from ddtrain.errors import DDTrainError

Image = pytest.importorskip("PIL.Image")


def _npz(tmp_path, name="d.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return str(path)


def _refused(path, match, **options):
    with pytest.raises(DDTrainError, match=match) as err:
        load_dataset(f"npz:{path}", **options)
    assert str(path) in str(err.value)  # the message names the file
    return str(err.value)


X = np.random.default_rng(0).random((40, 6, 6))
LABELS = np.arange(40) % 4


# ---------------------------------------------------------------- labels

def test_fractional_float_labels_are_refused_unless_regression_is_said(tmp_path):
    y = np.random.default_rng(1).random(40) * 3
    path = _npz(tmp_path, x=X, y=y)
    message = _refused(path, "non-integer values .* not class labels")
    assert "task=regression" in message and "index 0" in message
    data = load_dataset(f"npz:{path}", task="regression", val_fraction=0.0)
    assert data.task == "regression" and data.num_classes is None
    assert torch.allclose(data.train.y[:, 0], torch.from_numpy(y).float())
    with pytest.raises(DDTrainError, match="task='ranking' is not one of auto, classification, regression"):
        load_dataset(f"npz:{path}", task="ranking")


def test_integral_float_labels_are_classification(tmp_path):
    path = _npz(tmp_path, x=X, y=LABELS.astype(np.float64))  # 0.0, 1.0, 2.0, 3.0
    data = load_dataset(f"npz:{path}", val_fraction=0.0)
    assert data.task == "classification" and data.num_classes == 4
    assert data.train.y.dtype == torch.int64 and data.train.y.tolist() == LABELS.tolist()
    column = load_npz(_npz(tmp_path, "col.npz", x=X, y=LABELS[:, None]))  # (N, 1) labels
    assert column.num_classes == 4 and column.y.tolist() == LABELS.tolist()
    assert load_npz(path, task="regression").task == "regression"  # said explicitly


def test_integer_labels_with_task_classification_but_wrong_shape(tmp_path):
    path = _npz(tmp_path, x=X, y=np.zeros((40, 6, 6), dtype=np.int64))
    _refused(path, r"y has shape \(40, 6, 6\), not class labels", task="classification")


def test_negative_label_is_refused(tmp_path):
    y = LABELS.copy()
    y[17] = -1
    _refused(_npz(tmp_path, x=X, y=y), r"negative label \(-1 at index 17\); class labels must be 0..K-1")


def test_stray_label_is_refused_and_num_classes_overrides(tmp_path):
    y = np.arange(100) % 10
    y[63] = 999
    x = np.random.default_rng(0).random((100, 4, 4))
    path = _npz(tmp_path, x=x, y=y)
    message = _refused(path, r"labels run up to 999 \(at index 63\) but only 11 distinct values occur")
    assert "1000-class head" in message and "num_classes=K" in message
    assert load_npz(path, num_classes=1000).num_classes == 1000  # the user says so
    with pytest.raises(DDTrainError, match=r"label 999 \(at index 63\) is out of range for num_classes=10"):
        load_npz(path, num_classes=10)


def test_huge_label_is_refused_without_allocating(tmp_path):
    y = LABELS.astype(np.int64)
    y[5] = 2 ** 45
    start = time.perf_counter()
    _refused(_npz(tmp_path, x=X, y=y), "that would be a 35184372088833-class head")
    assert time.perf_counter() - start < 5


def test_labels_with_a_few_unused_classes_are_fine(tmp_path):
    y = np.array([1, 2, 3, 5] * 10)  # 1-based with a gap: 6 classes for 4 distinct labels
    assert load_npz(_npz(tmp_path, x=X, y=y)).num_classes == 6


def test_one_hot_rows_must_have_exactly_one_one(tmp_path):
    y = np.eye(4)[LABELS]
    y[9] = 0
    _refused(_npz(tmp_path, x=X, y=y), "row 9 has 0 ones")
    y[9, :2] = 1
    _refused(_npz(tmp_path, "two.npz", x=X, y=y), "row 9 has 2 ones")


# ---------------------------------------------------------------- arrays

@pytest.mark.parametrize("x, y, match", [
    (np.zeros((0, 6, 6)), np.zeros(0, dtype=np.int64), r"array x is empty \(shape \(0, 6, 6\)\): no samples"),
    (X, np.zeros(0, dtype=np.int64), r"array y is empty"),
    (np.zeros((40, 0, 0)), LABELS, r"array x has shape \(40, 0, 0\): every sample is empty"),
    (np.array(["a"] * 40), LABELS, r"array x holds text \(dtype <U1\), not numbers"),
    (X, np.array([b"cat"] * 40), r"array y holds bytes"),
    (X, LABELS + 1j, r"array y holds complex numbers"),
    (np.float64(3.0), np.int64(1), r"array x is a single value \(a 0-d array\)"),
    (X, np.int64(1), r"array y is a single value"),
    (X, LABELS[:39], "40 inputs in x but 39 targets in y"),
])
def test_unusable_arrays_are_refused(tmp_path, x, y, match):
    _refused(_npz(tmp_path, x=x, y=y), match)


def test_object_arrays_are_refused_without_unpickling(tmp_path):
    path = _npz(tmp_path, x=X, y=np.array([None] * 40, dtype=object))
    _refused(path, r"array y holds Python objects \(stored as a pickle\), which ddtrain does not load")


def test_non_finite_inputs_name_how_many_and_the_first(tmp_path):
    x = X.copy()
    x[31, 2, 2] = np.nan
    x[7, 0, 1] = np.inf
    message = _refused(_npz(tmp_path, x=x, y=LABELS), r"array x has non-finite values \(NaN or infinity\) "
                       r"in 2 of 40 samples, the first at index 7 \(inf\)")
    assert "remove or repair" in message
    x = X.copy()
    x[3, 0, 0] = 1e300  # finite in float64, infinite in the float32 the model sees
    _refused(_npz(tmp_path, "big.npz", x=x, y=LABELS), r"in 1 of 40 samples, the first at index 3")


def test_non_finite_values_in_the_validation_rows_are_refused_too(tmp_path):
    # the rows a seeded split sends to validation: a NaN there gave val_loss nan before
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    x = X.copy()
    x[int(order[0])] = np.nan
    _refused(_npz(tmp_path, x=x, y=LABELS), f"in 1 of 40 samples, the first at index {int(order[0])}",
             val_fraction=0.25)


def test_non_finite_regression_targets_are_refused(tmp_path):
    y = np.random.default_rng(1).random((40, 6, 6))
    y[12, 3, 3] = -np.inf
    _refused(_npz(tmp_path, x=X, y=y), r"array y has non-finite values .* the first at index 12 \(-inf\)")
    y = np.random.default_rng(1).random(40)
    y[4] = np.nan
    _refused(_npz(tmp_path, "labels.npz", x=X, y=y), r"array y has non-finite values .* index 4 \(nan\)")


def test_checks_cost_little_on_the_real_mnist(tmp_path, mnist_dir):
    """10,000 real MNIST images as a float npz: the checks add a small fraction of the load."""
    mnist = load_mnist(str(mnist_dir))
    path = _npz(tmp_path, x=mnist.x[:, 0].numpy().astype(np.float64), y=mnist.y.numpy())
    from ddtrain.data import arrays
    x64 = np.load(path)["x"].astype(np.float32)
    start = time.perf_counter()
    arrays.check_finite(x64, path, "x")
    arrays.class_labels(mnist.y.numpy(), path)
    checks_s = time.perf_counter() - start
    start = time.perf_counter()
    data = load_npz(path)
    load_s = time.perf_counter() - start
    assert data.num_classes == 10 and len(data) == 10_000
    assert checks_s < 0.5 * load_s + 0.05, (checks_s, load_s)


# ---------------------------------------------------------------- MNIST files

@pytest.mark.parametrize("damage, detail", [("flipped", "Error -3 while decompressing"),
                                            ("cut short", "ended before the end-of-stream marker"),
                                            ("crc", "CRC check failed")])
def test_damaged_gzip_names_the_file(tmp_path, mnist_dir, damage, detail):
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        shutil.copy(mnist_dir / name, tmp_path / name)
    bad = tmp_path / "t10k-images-idx3-ubyte.gz"
    raw = bytearray(bad.read_bytes())
    if damage == "flipped":
        raw[1000:1100] = bytes(b ^ 0xFF for b in raw[1000:1100])
    elif damage == "cut short":
        raw = raw[:len(raw) // 2]
    else:
        raw[-8] ^= 1  # the stored CRC-32 of the data
    bad.write_bytes(bytes(raw))
    with pytest.raises(DDTrainError) as err:
        load_dataset(f"mnist:{tmp_path}")
    message = str(err.value)
    assert message.startswith(f"{bad}: damaged gzip file, cannot decompress it (") and detail in message
    assert message.endswith("download it again")


def test_gzip_that_is_not_gzip_names_the_file(tmp_path):
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"<html>not found</html>")
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"\0\0\x08\x01\0\0\0\0"))
    with pytest.raises(DDTrainError, match=r"train-images-idx3-ubyte.gz: damaged gzip file"):
        load_mnist(str(tmp_path))


# ---------------------------------------------------------------- image folders

@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "images"
    for k, name in enumerate(("cat", "dog")):
        (root / name / "more").mkdir(parents=True)
        for j in range(3):
            Image.new("RGB", (12, 10), (80 * k, 40 * j, 0)).save(root / name / f"{name}_{j}.png")
        Image.new("RGB", (12, 10), (0, 0, 200)).save(root / name / "more" / "deep.png")
    return root


def _folder_refused(root, match, path):
    with pytest.raises(DDTrainError, match=match) as err:
        load_imagefolder(str(root), size=8)
    assert f"imagefolder: {path} " in str(err.value)
    return str(err.value)


def test_plain_folder_and_file_symlinks_still_load(folder):
    os.symlink(folder / "dog" / "dog_0.png", folder / "dog" / "alias.png")  # a file link is fine
    os.mkfifo(folder / "dog" / "notes")  # not an image name: ignored, never opened
    ds = load_imagefolder(str(folder), size=8)
    assert ds.classes == ["cat", "dog"] and len(ds) == 9
    assert ds.files[:4] == ["cat/cat_0.png", "cat/cat_1.png", "cat/cat_2.png", "cat/more/deep.png"]
    assert ds[ds.files.index("dog/alias.png")][0].shape == (3, 8, 8)


def test_symlink_to_a_parent_folder_is_refused(folder):
    link = folder / "cat" / "up"
    os.symlink("..", link)  # would label every dog image as a cat as well
    message = _folder_refused(folder, "leads back up to a folder that contains it", link)
    assert f"symlink to the folder {os.path.realpath(folder)}," in message


def test_two_self_links_are_refused_not_scanned_forever(folder):
    os.symlink(".", folder / "cat" / "again")
    os.symlink(".", folder / "cat" / "and_again")
    start = time.perf_counter()
    with pytest.raises(DDTrainError, match="symlink to the folder .* a loop"):
        load_imagefolder(str(folder), size=8)
    assert time.perf_counter() - start < 5


def test_symlink_that_resolves_to_itself_is_refused(folder):
    os.symlink("knot", folder / "dog" / "knot")
    _folder_refused(folder, r"is a symlink loop \(it leads back to itself: knot\)", folder / "dog" / "knot")


def test_folder_symlinks_out_of_the_root_or_across_classes_are_refused(folder, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", folder / "cat" / "out")
    _folder_refused(folder, "leads out of the data folder", folder / "cat" / "out")
    os.unlink(folder / "cat" / "out")
    os.symlink(folder / "dog" / "more", folder / "cat" / "borrowed")
    _folder_refused(folder, "leads to another folder of the data set", folder / "cat" / "borrowed")
    os.unlink(folder / "cat" / "borrowed")
    os.symlink(folder / "dog", folder / "puppy")  # a class that is another class
    _folder_refused(folder, "leads to another folder of the data set", folder / "puppy")


def test_fifo_among_the_images_is_refused_without_opening_it(folder):
    fifo = folder / "dog" / "stream.jpg"
    os.mkfifo(fifo)
    _folder_refused(folder, r"is a FIFO \(named pipe\), not an image file", fifo)  # opening it would block


def test_socket_and_device_among_the_images_are_refused(folder):
    path = folder / "cat" / "s.png"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        _folder_refused(folder, "is a socket, not an image file", path)
    os.unlink(path)
    device = folder / "cat" / "null.jpg"
    try:
        os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs root")
    _folder_refused(folder, "is a character device, not an image file", device)


def test_empty_image_file_is_skipped_and_named(folder):
    """Issue 30: a 0-byte image is left out at the scan (one line each, counted in the record), not a refusal."""
    empty = folder / "cat" / "more" / "blank.jpg"
    empty.touch()
    ds = load_imagefolder(str(folder), size=8)
    assert "cat/more/blank.jpg" not in ds.files and len(ds) == 8
    assert [(p.file, p.reason, p.action) for p in ds.scan_problems] == [(str(empty), "empty file (0 bytes)", "skipped")]


def test_dangling_image_symlink_is_refused(folder):
    link = folder / "dog" / "gone.png"
    os.symlink("deleted.png", link)
    _folder_refused(folder, r"is a symlink to deleted.png, which cannot be read \(No such file", link)


def test_a_path_of_the_wrong_kind_is_named(tmp_path):
    """Was: 'npz: file T/D does not exist' for a folder that exists."""
    npz = _npz(tmp_path, x=X, y=LABELS)
    with pytest.raises(DDTrainError, match=rf"^npz: {tmp_path} is a folder, not a \.npz file$"):
        load_dataset(f"npz:{tmp_path}")
    with pytest.raises(DDTrainError, match=rf"^mnist: {npz} is a file, not the folder of MNIST's \.gz files$"):
        load_dataset(f"mnist:{npz}")
    with pytest.raises(DDTrainError, match=rf"^imagefolder: {npz} is a file, not a folder of class folders$"):
        load_dataset(f"imagefolder:{npz}")
    with pytest.raises(DDTrainError, match=r"^npz: file .*nowhere.npz does not exist$"):
        load_dataset(f"npz:{tmp_path / 'nowhere.npz'}")
