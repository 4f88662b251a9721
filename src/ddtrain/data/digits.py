"""The 8x8 handwritten digits (UCI optdigits test set, 1,797 images) that ship with ddtrain.

They come from scikit-learn's copy of the UCI data, stored in ``digits.npz`` beside this
file. Pixels are 0..16; we scale to [0, 1] and, by default, resize to 28x28 (bilinear) so
that document 000's Simple-CNN, built for MNIST, takes them unchanged.
"""
from __future__ import annotations

from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F

from ddtrain.data.arrays import ArrayDataset


def load_digits(*, size: int = 28) -> ArrayDataset:
    with resources.files(__package__).joinpath("digits.npz").open("rb") as f:
        arrays = np.load(f)
        x, y = arrays["x"], arrays["y"]
    images = torch.from_numpy(x.astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
    if size != 8:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return ArrayDataset(images.contiguous(), torch.from_numpy(y.astype(np.int64)), num_classes=10)
