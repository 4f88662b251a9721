"""CIFAR-10 in its "python version" pickle batches, read by an unpickler that runs no code.

A directory (or its ``cifar-10-batches-py`` subdirectory, as the archive unpacks) holds
``data_batch_1`` .. ``data_batch_5`` (training, 10,000 images each) and ``test_batch``.
Each is a pickled dict with ``data`` (N x 3072 uint8, rows of 1024 red, 1024 green, 1024
blue values) and ``labels`` (N ints in 0..9), written by Python 2, so keys are bytes.

Pickle can run arbitrary code when it loads; a data file must never do that, so
``SafeUnpickler`` resolves only the names a numeric numpy array needs (``_reconstruct``
or ``_frombuffer``, ``ndarray``, ``dtype`` without object types) and Python 3's
protocol-2 spelling of bytes (``_codecs.encode`` to latin-1); any other global in the
file is refused, so everything else must be plain lists, dicts, bytes and ints.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from ddtrain.errors import DDTrainError
from ddtrain.data.arrays import ArrayDataset
from ddtrain.data.transforms import BatchDataset, int_option, resize_batch

TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILES = ["test_batch"]
PIXELS = 3 * 32 * 32


try:  # numpy >= 2 moved it; pickles written by either name it as they knew it
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct


def _frombuffer(buf, dtype, shape, order):
    return np.frombuffer(buf, dtype=dtype).reshape(shape, order=order)


def _plain_dtype(spec, *args):
    dtype = np.dtype(spec, *args)
    if dtype.hasobject:
        raise pickle.UnpicklingError("object arrays are not allowed in a data file")
    return dtype


def _encode(text, encoding="utf-8"):
    """Protocol-2 pickles from Python 3 spell bytes as ``_codecs.encode(str, 'latin1')``."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("unexpected _codecs.encode call in a data file")
    return text.encode("latin-1")


class SafeUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numeric numpy arrays; refuses every other global."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy.core.numeric", "_frombuffer"): _frombuffer,
        ("numpy._core.numeric", "_frombuffer"): _frombuffer,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): _plain_dtype,
        ("_codecs", "encode"): _encode,
    }

    def find_class(self, module, name):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a data file may only "
                                         f"hold plain values and numeric arrays") from None


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 batch file as (N, 3, 32, 32) uint8 images and (N,) int64 labels, checked."""
    try:
        with open(path, "rb") as f:
            batch = SafeUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, AttributeError,
            KeyError, OverflowError, MemoryError) as exc:
        raise DDTrainError(f"{path}: not a readable CIFAR-10 pickle batch "
                           f"(truncated, corrupt or not a pickle: {exc})") from None
    except OSError as exc:
        raise DDTrainError(f"{path}: cannot read ({exc})") from None
    if not isinstance(batch, dict):
        raise DDTrainError(f"{path}: holds a {type(batch).__name__}, not the dict of a CIFAR-10 batch")
    batch = {k.decode("latin-1") if isinstance(k, bytes) else k: v for k, v in batch.items()}
    missing = {"data", "labels"} - set(batch)
    if missing:
        raise DDTrainError(f"{path}: missing key(s) {sorted(missing)} of a CIFAR-10 batch; "
                           f"has {sorted(map(str, batch))}")
    data, labels = batch["data"], batch["labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != PIXELS:
        desc = f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DDTrainError(f"{path}: 'data' is a {desc}; a CIFAR-10 batch has N x {PIXELS} uint8 rows")
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError):
        raise DDTrainError(f"{path}: 'labels' is not a list of integers") from None
    if labels.ndim != 1 or len(labels) != len(data):
        raise DDTrainError(f"{path}: {len(data)} images but {labels.size} labels")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise DDTrainError(f"{path}: label {int(labels.max() if labels.max() > 9 else labels.min())} "
                           f"is not a CIFAR-10 class (0..9)")
    return data.reshape(-1, 3, 32, 32), labels


def _root(path: str) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise DDTrainError(f"cifar10: {root} is a file, not the folder of CIFAR-10's batches" if root.exists() else
                           f"cifar10: data directory {root} does not exist")
    if not (root / "test_batch").exists() and (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    return root


class _Resized:
    """Images kept as uint8 at 32x32 and resized per batch (document 003's 128x128 would be 9.8 GB as floats)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, size: int):
        self.images, self.labels, self.size = images, labels, size

    def __call__(self, idx):
        idx = idx.to(self.images.device)
        return resize_batch(self.images[idx].float().div_(255), self.size), self.labels[idx]

    def to(self, device):
        return _Resized(self.images.to(device), self.labels.to(device), self.size)


def load_cifar10(path: str, *, split: str = "auto", resize=None):
    """``cifar10:DIR`` with options:

    split   train (data_batch_1..5), test (test_batch) or auto: train when any training
            batch is there, else test
    resize  image side in pixels, e.g. 128 as document 003 does; resized per batch
            (bilinear), so memory stays that of the 32x32 images

    Images are float32 in [0, 1], (N, 3, 32, 32) or (N, 3, resize, resize).
    """
    root = _root(path)
    if split not in ("auto", "train", "test"):
        raise DDTrainError(f"cifar10: unknown split {split!r}; valid: auto, test, train")
    if split == "auto":
        split = "train" if any((root / f).exists() for f in TRAIN_FILES) else "test"
    names = TRAIN_FILES if split == "train" else TEST_FILES
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise DDTrainError(f"cifar10: {root} lacks {', '.join(missing)} (the {split} batches of the "
                           f"CIFAR-10 python version)")
    parts = [read_batch(root / n) for n in names]
    images = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    if resize is None or int_option("resize", resize, fmt="cifar10") == 32:
        return ArrayDataset(images.float().div_(255), labels, num_classes=10)
    size = int_option("resize", resize, fmt="cifar10")
    return BatchDataset(_Resized(images, labels, size), len(labels), num_classes=10, sample_shape=(3, size, size))
