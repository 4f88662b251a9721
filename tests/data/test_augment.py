"""The batched augmentation against torchvision's published algorithm and against Pillow's pixels (issue 30).

torchvision itself cannot be imported on the CPU machines these tests run on (no CPU build of
it exists there), so the reference for the crop geometry is a re-implementation of
``torchvision.transforms.RandomResizedCrop.get_params`` (torchvision 0.2x, read from its
source) written here, line for line, on numpy's random generator: nothing of ddtrain's code or
of torch's generator is shared with what is tested. The distributions are compared with the
two-sample Kolmogorov-Smirnov statistic (written out below) at a 0.1 % level, and the test
shows it has the power to see a wrong sampler. The pixels are compared with Pillow's
``crop(box).resize(size, BILINEAR)`` (torchvision's PIL path) and ``resize`` + centre crop
(``Resize(256)`` + ``CenterCrop(224)``).
"""
import math

import numpy as np
import pytest
import torch
from PIL import Image

from ddtrain.data import augment
from ddtrain.data.transforms import random_resized_crop_box

DRAWS = 20000
ALPHA_C = math.sqrt(-math.log(0.001 / 2) / 2)      # two-sample KS critical constant at alpha = 0.001


def torchvision_get_params(rng, height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """RandomResizedCrop.get_params: (top, left, h, w), torchvision's loop and fallback."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = int(rng.integers(0, height - h + 1))
            j = int(rng.integers(0, width - w + 1))
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def ks_statistic(a, b) -> float:
    """sup |F_a - F_b| over the pooled values (ties handled by evaluating both CDFs after each value)."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.union1d(a, b)
    return float(np.max(np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(b, grid, "right") / len(b))))


def features(boxes, height, width):
    """What the crop distribution is about: area share, log aspect, where it sits (0..1 of the free room)."""
    top, left, h, w = (np.asarray(v, float) for v in boxes)
    room_y, room_x = np.maximum(height - h, 1), np.maximum(width - w, 1)
    return {"scale": h * w / (height * width), "log_aspect": np.log(w / h), "top": top / room_y, "left": left / room_x}


def reference_boxes(height, width, seed=1):
    rng = np.random.default_rng(seed)
    return list(zip(*(torchvision_get_params(rng, height, width) for _ in range(DRAWS))))


def ours_vectorised(height, width, seed=2):
    top, left, h, w = augment.sample_boxes(torch.full((DRAWS,), height), torch.full((DRAWS,), width),
                                           torch.Generator().manual_seed(seed))
    return top.numpy(), left.numpy(), h.numpy(), w.numpy()


def ours_per_sample(height, width, seed=3):
    gen = torch.Generator().manual_seed(seed)
    boxes = [random_resized_crop_box(width, height, gen) for _ in range(DRAWS // 4)]
    return ([b[1] for b in boxes], [b[0] for b in boxes], [b[3] - b[1] for b in boxes], [b[2] - b[0] for b in boxes])


# (900, 300) and (40, 400) fall back to the centre crop in part of the draws: an atom the KS test weighs too
@pytest.mark.parametrize("height, width", [(375, 500), (64, 64), (900, 300), (40, 400)])
@pytest.mark.parametrize("sampler", [ours_vectorised, ours_per_sample])
def test_crop_statistics_match_torchvision(height, width, sampler):
    ref = features(reference_boxes(height, width), height, width)
    got = features(sampler(height, width), height, width)
    n, m = DRAWS, len(got["scale"])
    critical = ALPHA_C * math.sqrt((n + m) / (n * m))
    for name in ref:
        d = ks_statistic(ref[name], got[name])
        assert d < critical, f"{name}: KS {d:.4f} >= {critical:.4f} for {width}x{height} ({sampler.__name__})"


def test_the_fallback_is_torchvisions_centre_crop():
    """A 1000x20 strip never fits 3/4..4/3 by sampling: every draw is the centre 27x20 (as torchvision)."""
    top, left, h, w = ours_vectorised(20, 1000)
    assert set(zip(top, left, h, w)) == {torchvision_get_params(np.random.default_rng(0), 20, 1000)} == {(0, 486, 20, 27)}


def test_the_statistics_test_sees_a_wrong_sampler():
    """Power: aspect drawn uniformly in 3/4..4/3 (not log-uniformly) is caught at these draws."""
    rng = np.random.default_rng(5)
    height, width = 375, 500

    def wrong():
        for _ in range(10):
            area = height * width * rng.uniform(0.08, 1.0)
            aspect = rng.uniform(3 / 4, 4 / 3)
            w, h = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
        return 0, 0, height, width
    ref = features(reference_boxes(height, width), height, width)
    bad = features(list(zip(*(wrong() for _ in range(DRAWS)))), height, width)
    critical = ALPHA_C * math.sqrt(2 / DRAWS)
    assert ks_statistic(ref["log_aspect"], bad["log_aspect"]) > critical


# ---------------------------------------------------------------- pixels against Pillow

def photo(height, width, seed):
    """A smooth gradient with noise: what resampling errors show on."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 / width, y * 255 / height, (x + y) * 128 / (height + width)], -1)
    return np.clip(pixels + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)


SHAPES = [(375, 500), (64, 80), (300, 200), (20, 1000), (41, 37)]   # the 20-row strip and 41x37 are upsampled


def _batch(shapes, seed=0):
    images = [photo(h, w, seed + k) for k, (h, w) in enumerate(shapes)]
    return images, [torch.from_numpy(a).permute(2, 0, 1) for a in images]


def _assert_close_to_pillow(got, reference, what):
    diff = np.abs(got.astype(np.float64) - reference.astype(np.float64))
    # Pillow resamples in 8-bit fixed point, rounding between its two passes: at most ~1 level apart
    assert diff.mean() < 0.5 and diff.max() <= 2.0, f"{what}: mean {diff.mean():.3f}, max {diff.max():.3f} levels"


@pytest.mark.parametrize("size", [56, 224])
def test_training_crops_match_pillow_crop_resize_and_flip(size):
    images, tensors = _batch(SHAPES)
    plan = augment.train_plan(torch.tensor([a.shape[0] for a in images]), torch.tensor([a.shape[1] for a in images]),
                              size, torch.Generator().manual_seed(size))
    plan.flip[:] = torch.tensor([True, False, True, False, True])
    out = augment.apply(tensors, plan, size, normalize=False)
    assert out.shape == (len(images), 3, size, size) and out.dtype == torch.float32
    for k, a in enumerate(images):
        top, left = int(plan.rows.start[k]), int(plan.cols.start[k])
        h, w = int(plan.rows.length[k]), int(plan.cols.length[k])
        reference = np.asarray(Image.fromarray(a).crop((left, top, left + w, top + h)).resize((size, size), Image.BILINEAR))
        if plan.flip[k]:
            reference = reference[:, ::-1]
        _assert_close_to_pillow(out[k].permute(1, 2, 0).numpy() * 255, reference, f"image {a.shape}")


@pytest.mark.parametrize("size", [56, 224])
def test_evaluation_matches_resize_256_then_centre_crop_224(size):
    images, tensors = _batch(SHAPES, seed=10)
    plan = augment.eval_plan(torch.tensor([a.shape[0] for a in images]), torch.tensor([a.shape[1] for a in images]), size)
    out = augment.apply(tensors, plan, size, normalize=False)
    side = size * 8 // 7                                   # 256 for 224: torchvision's reference recipe
    for k, a in enumerate(images):
        h, w = a.shape[:2]
        new_w, new_h = (side, int(side * h / w)) if w <= h else (int(side * w / h), side)
        resized = Image.fromarray(a).resize((new_w, new_h), Image.BILINEAR)
        top, left = int(round((new_h - size) / 2)), int(round((new_w - size) / 2))
        reference = np.asarray(resized.crop((left, top, left + size, top + size)))
        _assert_close_to_pillow(out[k].permute(1, 2, 0).numpy() * 255, reference, f"image {a.shape}")


def test_normalisation_chunking_and_batch_order():
    """Small chunks (sorted by size, scattered back) give what one chunk gives; normalisation is ImageNet's."""
    images, tensors = _batch(SHAPES * 3, seed=20)
    heights, widths = torch.tensor([a.shape[0] for a in images]), torch.tensor([a.shape[1] for a in images])
    plan = augment.train_plan(heights, widths, 32, torch.Generator().manual_seed(0))
    whole = augment.apply(tensors, plan, 32, normalize=False, chunk_bytes=1 << 40)
    chunked = augment.apply(tensors, plan, 32, normalize=False, chunk_bytes=1)   # one image per chunk
    assert torch.allclose(whole, chunked, atol=1e-5)
    normalised = augment.apply(tensors, plan, 32, normalize=True)
    mean, std = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    assert torch.allclose(normalised, (whole - mean) / std, atol=1e-5)


def test_the_gpus_float16_resampling_stays_within_a_grey_level_of_pillow(monkeypatch):
    """CUDA resamples in float16 (REGION_DTYPE); the same arithmetic on the CPU is as close to Pillow as float32."""
    monkeypatch.setitem(augment.REGION_DTYPE, "cpu", torch.float16)
    images, tensors = _batch(SHAPES, seed=3)
    plan = augment.train_plan(torch.tensor([a.shape[0] for a in images]), torch.tensor([a.shape[1] for a in images]),
                              224, torch.Generator().manual_seed(3))
    out = augment.apply(tensors, plan, 224, normalize=False)
    assert out.dtype == torch.float32
    for k, a in enumerate(images):
        top, left = int(plan.rows.start[k]), int(plan.cols.start[k])
        h, w = int(plan.rows.length[k]), int(plan.cols.length[k])
        reference = np.asarray(Image.fromarray(a).crop((left, top, left + w, top + h)).resize((224, 224), Image.BILINEAR))
        if plan.flip[k]:
            reference = reference[:, ::-1]
        _assert_close_to_pillow(out[k].permute(1, 2, 0).numpy() * 255, reference, f"float16, image {a.shape}")


def test_regions_gathers_each_crop_from_every_memory_layout():
    """The one-gather region copy (augment.regions) equals a slice per image, whatever the images' layout.

    The batch mixes nvjpeg's contiguous CHW tensors, the loader's HWC views (permuted, several sharing one
    buffer at offsets) and a strided view that is no permutation of contiguous memory. Pins the index
    arithmetic: a stride taken from the wrong dimension, the crop's top/left offset dropped, or one image's
    base offset used for another, each puts the wrong pixels here. Past a region's own size only the
    (zero-weighted) repeat of its last row and column may differ from zero padding.
    """
    g = torch.Generator().manual_seed(7)
    shapes = [(37, 53), (53, 37), (1, 1), (20, 21), (31, 17)]
    shared = torch.randint(0, 256, (sum(h * w * 3 for h, w in shapes[:2]),), dtype=torch.uint8, generator=g)
    images = [shared[:37 * 53 * 3].view(37, 53, 3).permute(2, 0, 1),             # HWC views of one buffer
              shared[37 * 53 * 3:].view(53, 37, 3).permute(2, 0, 1),
              torch.randint(0, 256, (3, 1, 1), dtype=torch.uint8, generator=g),    # contiguous CHW
              torch.randint(0, 256, (3, 20, 21), dtype=torch.uint8, generator=g),
              torch.randint(0, 256, (3, 31, 34), dtype=torch.uint8, generator=g)[:, :, ::2]]   # strided
    plan = augment.train_plan(torch.tensor([h for h, _ in shapes]), torch.tensor([w for _, w in shapes]), 16,
                              torch.Generator().manual_seed(1))
    chunk = [4, 0, 2, 3, 1]                                                     # not the batch's order
    hp, wp = max(int(plan.rows.length[k]) for k in chunk), max(int(plan.cols.length[k]) for k in chunk)
    got = augment.regions(images, plan, chunk, hp, wp)
    assert got.shape == (5, hp, 3, wp) and got.dtype == torch.uint8
    for slot, k in enumerate(chunk):
        top, left = int(plan.rows.start[k]), int(plan.cols.start[k])
        h, w = int(plan.rows.length[k]), int(plan.cols.length[k])
        assert torch.equal(got[slot, :h, :, :w].permute(1, 0, 2), images[k][:, top:top + h, left:left + w]), f"{k}"
