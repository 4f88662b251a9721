"""ImageNet-style class folders (``DIR/<class>/<image>``).

Classes are the sub-folder names in sorted order (index 0 is the first), as torchvision's
ImageFolder numbers them, so labels agree with models trained elsewhere. If DIR holds
``train/`` (ImageNet's layout), ``split`` chooses ``train`` or ``val`` inside it.

Training samples get the standard augmentation (random-resized-crop to ``size``, scale
0.08..1 and aspect 3/4..4/3, then a horizontal flip half the time); evaluation samples are
resized so the short side is size/0.875 (256 for 224) and centre-cropped. The validation view
that ``load_dataset`` splits off gets the evaluation transform (``eval_view``). Decoding and
augmentation run per sample with Pillow in the loader processes, or per batch on the training
GPU (nvjpeg and batched tensor ops): ``ddtrain.data.images`` says which, and what happens to
files that cannot be decoded. Empty files are skipped at the scan (reported once, counted).
"""
from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddtrain.data.decode import SKIPPED, BadImage, Problem, decode_pillow
from ddtrain.data.images import ImageDataset, pipeline_option
from ddtrain.data.transforms import bool_option, fraction_option, int_option
from ddtrain.errors import DDTrainError

EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise DDTrainError("imagefolder needs Pillow: pip install ddtrain[imaging]") from None
    return Image


def scan(root: Path, empty: list | None = None) -> tuple[list[str], list[str], np.ndarray]:
    """(class names, image paths relative to root, labels) of a class-folder tree.

    The walk follows no directory symlink: one leading out of the data folder, back up into a
    folder that contains it (a loop) or into another folder of the tree (images counted twice,
    or under another class) is refused, naming the link. Every file with an image extension
    must be a regular file: FIFOs, devices and sockets are refused here, never opened (reading a
    FIFO blocks forever), and so are symlinks that lead nowhere. Empty (0-byte) image files are
    left out and their paths appended to ``empty`` (the caller reports them). Costs one ``stat``
    per image, no decoding.
    """
    top = os.path.realpath(root)
    classes = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        if entry.is_symlink():
            info = _link_target(entry.path, is_image=False)
            if info is not None and stat.S_ISDIR(info.st_mode):
                raise _folder_link_error(entry.path, top)
        elif entry.is_dir(follow_symlinks=False):
            classes.append(entry.name)
    if not classes:
        raise DDTrainError(f"imagefolder: {root} has no class sub-folders (expected {root}/<class>/<image>.jpg)")
    files, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(os.path.join(name, path) for path in _images(os.path.join(root, name), top, empty))
        if not found:
            raise DDTrainError(f"imagefolder: class folder {root / name} holds no images ({', '.join(EXTENSIONS)})")
        files += found
        labels += [label] * len(found)
    return classes, files, np.asarray(labels, dtype=np.int64)


def _images(folder: str, top: str, empty: list | None) -> list[str]:
    """Image paths under ``folder``, relative to it; directory symlinks are refused, not followed."""
    found, pending = [], [folder]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                is_image = entry.name.lower().endswith(EXTENSIONS) and not entry.name.startswith(".")
                if entry.is_symlink():
                    info = _link_target(entry.path, is_image)
                    if info is None:
                        continue
                    if stat.S_ISDIR(info.st_mode):
                        raise _folder_link_error(entry.path, top)
                elif entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                    continue
                elif not is_image:
                    continue
                else:
                    info = entry.stat(follow_symlinks=False)
                if not is_image:
                    continue
                if not stat.S_ISREG(info.st_mode):
                    raise DDTrainError(f"imagefolder: {entry.path} is a {_kind(info.st_mode)}, not an image file; "
                                       f"remove it from the data folder (ddtrain does not open it: reading a FIFO "
                                       f"or a device can block forever)")
                if info.st_size == 0:
                    if empty is not None:
                        empty.append(entry.path)
                    continue
                found.append(os.path.relpath(entry.path, folder))
    return found


def _link_target(path: str, is_image: bool):
    """The stat of what the symlink ``path`` points at; None for a dangling link to a non-image name."""
    try:
        return os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DDTrainError(f"imagefolder: {path} is a symlink loop (it leads back to itself: "
                               f"{os.readlink(path)}); remove it") from None
        if not is_image:
            return None
        raise DDTrainError(f"imagefolder: {path} is a symlink to {os.readlink(path)}, which cannot be read "
                           f"({exc.strerror}); remove it or restore its target") from None


def _folder_link_error(path: str, top: str) -> DDTrainError:
    target = os.path.realpath(path)
    inside = os.path.commonpath([top, target]) == top
    if os.path.commonpath([target, os.path.realpath(os.path.dirname(path))]) == target:
        why = "back up to a folder that contains it: a loop, its images counted again under this class"
    elif not inside:
        why = "out of the data folder"
    else:
        why = "to another folder of the data set: its images would be counted twice, perhaps under another class"
    return DDTrainError(f"imagefolder: {path} is a symlink to the folder {target}, which leads {why}; ddtrain "
                        f"follows no folder symlinks inside the data folder: replace it with a real folder "
                        f"(or give the linked folder itself as the data) or remove it")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISDIR, "folder")):
        if test(mode):
            return name
    return "special file"


@dataclass
class ImageFolderDataset(ImageDataset):
    """Paths and labels in memory; a sample's bytes read from its file when it is used."""

    root: Path = Path(".")
    files: list[str] = field(default_factory=list)

    def read(self, i: int) -> bytearray:
        """The file's bytes (a bytearray: writable, so torch takes it without a copy)."""
        with open(self.root / self.files[i], "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            got = f.readinto(data)
        return data if got == len(data) else data[:got]

    def name(self, i: int) -> str:
        return str(self.root / self.files[i])

    def _take(self, idx: np.ndarray) -> dict:
        return {"files": [self.files[j] for j in idx]}


def decode(path: Path):
    """Open and fully decode one image as RGB, or raise one DDTrainError naming the file."""
    try:
        return decode_pillow(Path(path).read_bytes())
    except BadImage as exc:
        raise DDTrainError(f"{path}: {exc}") from None


def load_imagefolder(path: str, *, size=224, split: str = "auto", augment=True, normalize=True, pipeline="auto",
                     cpu_decode=0):
    """``imagefolder:DIR`` with options:

    size       side of the square images the model sees (default 224)
    split      auto (DIR/train if it exists, else DIR), train, val, or any sub-folder name
    augment    random-resized-crop + flip for training samples (false: eval transform for all)
    normalize  subtract ImageNet's channel means and divide by its stds (default true)
    pipeline   auto, gpu or cpu: where images are decoded and augmented (ddtrain.data.images)
    cpu_decode 0 to 1: on the GPU path, the fraction of each batch's JPEGs the loader processes decode
               (the rest nvjpeg decodes on the training GPU; default 0)
    """
    _pillow()
    root = Path(path)
    if not root.is_dir():
        raise DDTrainError(f"imagefolder: {root} is a file, not a folder of class folders" if root.exists() else
                           f"imagefolder: data directory {root} does not exist")
    if split == "auto":
        root = root / "train" if (root / "train").is_dir() else root
    else:
        if not (root / split).is_dir():
            raise DDTrainError(f"imagefolder: {root} has no {split}/ sub-folder for split={split!r}")
        root = root / split
    empty: list[str] = []
    classes, files, labels = scan(root, empty)
    return ImageFolderDataset(classes=classes, labels=labels, root=root, files=files,
                              size=int_option("size", size, minimum=8, fmt="imagefolder"),
                              train=bool_option("augment", augment, fmt="imagefolder"),
                              normalize=bool_option("normalize", normalize, fmt="imagefolder"),
                              pipeline=pipeline_option(pipeline, "imagefolder"),
                              cpu_decode=fraction_option("cpu_decode", cpu_decode, fmt="imagefolder"),
                              scan_problems=[Problem(p, "empty file (0 bytes)", SKIPPED) for p in empty])
