"""ImageNet-style class folders (``DIR/<class>/<image>``), decoded with Pillow one sample at a time.

Classes are the sub-folder names in sorted order (index 0 is the first), as torchvision's
ImageFolder numbers them, so labels agree with models trained elsewhere. If DIR holds
``train/`` (ImageNet's layout), ``split`` chooses ``train`` or ``val`` inside it.

Training samples get the standard augmentation (random-resized-crop to ``size``, scale
0.08..1 and aspect 3/4..4/3, then a horizontal flip half the time); evaluation samples are
resized so the short side is size/0.875 (256 for 224) and centre-cropped. Crop and resize
are one Pillow ``resize(box=...)`` call (one resampling, antialiased). The validation view
that ``load_dataset`` splits off gets the evaluation transform (``eval_view``).
Randomness comes from torch's global generator, which DataLoader seeds per worker.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ddtrain.errors import DDTrainError
from ddtrain.data.transforms import bool_option, center_crop_box, int_option, normalize_, random_resized_crop_box

EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise DDTrainError("imagefolder needs Pillow: pip install ddtrain[imaging]") from None
    return Image


def scan(root: Path) -> tuple[list[str], list[str], np.ndarray]:
    """(class names, image paths relative to root, labels) of a class-folder tree."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DDTrainError(f"imagefolder: {root} has no class sub-folders (expected {root}/<class>/<image>.jpg)")
    files, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(os.path.join(name, os.path.relpath(os.path.join(d, f), root / name))
                       for d, _, fs in os.walk(root / name, followlinks=True) for f in fs
                       if f.lower().endswith(EXTENSIONS) and not f.startswith("."))
        if not found:
            raise DDTrainError(f"imagefolder: class folder {root / name} holds no images ({', '.join(EXTENSIONS)})")
        files += found
        labels += [label] * len(found)
    return classes, files, np.asarray(labels, dtype=np.int64)


@dataclass
class ImageFolderDataset(Dataset):
    """Paths and labels in memory; pixels decoded per ``__getitem__``."""

    root: Path
    classes: list[str]
    files: list[str]
    labels: np.ndarray
    size: int = 224
    train: bool = True
    normalize: bool = True

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return (3, self.size, self.size)

    task = "classification"

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i):
        path = self.root / self.files[i]
        image = decode(path)
        if self.train:
            box = random_resized_crop_box(*image.size)
            image = image.resize((self.size, self.size), _pillow().BILINEAR, box=box)
            flip = bool(torch.rand(()) < 0.5)
        else:
            box = center_crop_box(*image.size, self.size)
            image = image.resize((self.size, self.size), _pillow().BILINEAR, box=box)
            flip = False
        pixels = np.asarray(image, dtype=np.uint8)
        if flip:
            pixels = pixels[:, ::-1]
        x = torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))).float().div_(255)
        if self.normalize:
            normalize_(x)
        return x, int(self.labels[i])

    def select(self, idx) -> "ImageFolderDataset":
        idx = np.asarray(torch.as_tensor(idx).cpu(), dtype=np.int64)
        return replace(self, files=[self.files[j] for j in idx], labels=self.labels[idx])

    def eval_view(self) -> "ImageFolderDataset":
        """The same images with the evaluation transform (resize + centre crop, no flip)."""
        return replace(self, train=False)


def decode(path: Path):
    """Open and fully decode one image as RGB, or raise one DDTrainError naming the file."""
    Image = _pillow()
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DDTrainError(f"{path}: unreadable image ({exc})") from None


def load_imagefolder(path: str, *, size=224, split: str = "auto", augment=True, normalize=True):
    """``imagefolder:DIR`` with options:

    size       side of the square images the model sees (default 224)
    split      auto (DIR/train if it exists, else DIR), train, val, or any sub-folder name
    augment    random-resized-crop + flip for training samples (false: eval transform for all)
    normalize  subtract ImageNet's channel means and divide by its stds (default true)
    """
    _pillow()
    root = Path(path)
    if not root.is_dir():
        raise DDTrainError(f"imagefolder: data directory {root} does not exist")
    if split == "auto":
        root = root / "train" if (root / "train").is_dir() else root
    else:
        if not (root / split).is_dir():
            raise DDTrainError(f"imagefolder: {root} has no {split}/ sub-folder for split={split!r}")
        root = root / split
    classes, files, labels = scan(root)
    return ImageFolderDataset(root, classes, files, labels,
                              size=int_option("size", size, minimum=8, fmt="imagefolder"),
                              train=bool_option("augment", augment, fmt="imagefolder"),
                              normalize=bool_option("normalize", normalize, fmt="imagefolder"))
