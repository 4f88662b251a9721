"""Batched image augmentation in plain torch: the same geometry as torchvision, a whole batch per call.

Training: random-resized-crop (area 0.08..1 of the image, aspect 3/4..4/3 drawn log-uniformly,
ten tries, then torchvision's centre-crop fallback) to ``size`` x ``size``, and a horizontal flip
half the time. Evaluation: resize the short side to ``floor(size / 0.875)`` (256 for 224, the
long side ``int(256 * long / short)``), then the centre ``size`` x ``size`` crop, as torchvision's
``Resize(256)`` + ``CenterCrop(224)``. Then ``/255`` and ImageNet's normalisation.

Crop, resize and flip are one linear map per image and axis: an output row is a weighted sum
of input rows, with the weights of antialiased bilinear resampling (the triangle filter widened
by the shrink factor, renormalised at the crop's edges: what Pillow's ``crop(box).resize(size,
BILINEAR)`` and ``torch.nn.functional.interpolate(antialias=True)`` compute). So a batch of
images of any sizes becomes two batched matrix products, ``Wy @ image @ Wx^T``, with the
(size x rows) and (size x columns) weight matrices computed for all images at once; the flip
is the column weights reversed. The crop regions of a batch are gathered by one index (``regions``);
no per-image kernel runs. It runs wherever the tensors are (CUDA on the
training GPU, the CPU in tests).

The crop boxes are drawn on the CPU from a ``torch.Generator``, all ten tries of every image at
once (the first valid try is the one torchvision's loop would keep, so the distribution is the
same).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ddtrain.data.transforms import EVAL_CROP_FRACTION, IMAGENET_MEAN, IMAGENET_STD

SCALE, RATIO, TRIES = (0.08, 1.0), (3 / 4, 4 / 3), 10
# float32 bytes of one padded chunk of crop regions: bounds the temporary memory of a batch of
# large images (a 256-image batch of 4000x3000 photos would otherwise pad to 37 GB)
CHUNK_BYTES = {"cuda": 768 << 20, "cpu": 128 << 20}


def sample_boxes(heights: torch.Tensor, widths: torch.Tensor, generator: torch.Generator | None = None,
                 scale=SCALE, ratio=RATIO, tries: int = TRIES) -> tuple[torch.Tensor, ...]:
    """(top, left, height, width) of one random-resized-crop box per image, torchvision's algorithm, vectorised.

    The draws come from ``generator`` (torch's, so a seed gives the same boxes); the arithmetic on them is
    numpy's. torch's CPU kernels for these few thousand numbers cost 13-18 ms each (sqrt, round, exp of a
    256 x 10 float64 tensor) with 2 intra-op threads on a loaded 2-core machine against 3-60 us with one
    (measured 2026-11-28; 0.5-0.8 ms each on the GPU machine under its 15 loader processes,
    results/gpu_input/pipeline_profile_gather.txt): numpy runs them in the calling thread.
    """
    h_img, w_img = np.asarray(heights, dtype=np.float64), np.asarray(widths, dtype=np.float64)
    n = len(h_img)
    r = torch.rand((n, tries, 2), generator=generator, dtype=torch.float64).numpy()
    target = (h_img * w_img)[:, None] * (scale[0] + r[..., 0] * (scale[1] - scale[0]))
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = np.exp(log_lo + r[..., 1] * (log_hi - log_lo))
    w = np.round(np.sqrt(target * aspect))    # round half to even, as Python's round in torchvision
    h = np.round(np.sqrt(target / aspect))
    ok = (w > 0) & (w <= w_img[:, None]) & (h > 0) & (h <= h_img[:, None])
    first = ok.argmax(1)                      # the first valid try
    w, h = w[np.arange(n), first], h[np.arange(n), first]
    found = ok.any(1)
    # fallback: the whole image, centre-cropped to the nearest allowed aspect
    in_ratio = w_img / h_img
    fb_w = np.where(in_ratio > max(ratio), np.round(h_img * max(ratio)), w_img)
    fb_h = np.where(in_ratio < min(ratio), np.round(w_img / min(ratio)), h_img)
    w, h = np.where(found, w, fb_w), np.where(found, h, fb_h)
    u = torch.rand((n, 2), generator=generator, dtype=torch.float64).numpy()
    top = np.where(found, np.floor(u[:, 0] * (h_img - h + 1)), np.floor((h_img - h) / 2))
    left = np.where(found, np.floor(u[:, 1] * (w_img - w + 1)), np.floor((w_img - w) / 2))
    return tuple(torch.from_numpy(v.astype(np.int64)) for v in (top, left, h, w))


def eval_resize_side(size: int, fraction: float = EVAL_CROP_FRACTION) -> int:
    """The short side the evaluation resize gives before the centre crop: floor(size / 0.875), 256 for 224 (timm's rule)."""
    return int(math.floor(size / fraction + 1e-9))


@dataclass
class Axis:
    """One axis of every image's linear map: output pixel i samples around ``src0 + (i + offset + 0.5) * step``.

    Coordinates are relative to the crop region copied for the image (its first pixel ``start``,
    ``length`` pixels); pixels outside ``[0, length)`` never contribute.
    """

    start: torch.Tensor      # (N,) int64: first pixel of the region in the image
    length: torch.Tensor     # (N,) int64: pixels in the region
    src0: torch.Tensor       # (N,) float64
    step: torch.Tensor       # (N,) float64: input pixels per output pixel
    offset: torch.Tensor     # (N,) float64: output index of the first kept pixel (the eval centre crop)


@dataclass
class Plan:
    rows: Axis
    cols: Axis
    flip: torch.Tensor       # (N,) bool


def train_plan(heights, widths, size: int, generator: torch.Generator | None = None, flip_p: float = 0.5) -> Plan:
    """Random-resized-crop boxes and flips for a batch (crop first, then resize: no pixel outside the box counts)."""
    top, left, h, w = sample_boxes(heights, widths, generator)
    flip = torch.rand(len(top), generator=generator) < flip_p
    zeros = torch.zeros(len(top), dtype=torch.float64)
    return Plan(Axis(top, h, zeros, h.double() / size, zeros), Axis(left, w, zeros, w.double() / size, zeros), flip)


def plan(heights, widths, size: int, train: bool, generator: torch.Generator | None = None) -> Plan:
    """A batch's crops: random (training) or the centre crop (evaluation)."""
    return train_plan(heights, widths, size, generator) if train else eval_plan(heights, widths, size)


def eval_plan(heights, widths, size: int, fraction: float = EVAL_CROP_FRACTION) -> Plan:
    """torchvision's ``Resize(floor(size/fraction))`` then ``CenterCrop(size)``, as a region and a map per axis."""
    h_img, w_img = heights.to(torch.long), widths.to(torch.long)
    side = eval_resize_side(size, fraction)
    short = torch.minimum(h_img, w_img)
    # torchvision: the short side becomes `side`, the long side int(side * long / short)
    h_new = torch.where(h_img <= w_img, torch.full_like(h_img, side), (side * h_img.double() / short).floor().long())
    w_new = torch.where(w_img < h_img, torch.full_like(w_img, side), (side * w_img.double() / short).floor().long())
    return Plan(_eval_axis(h_img, h_new, size), _eval_axis(w_img, w_new, size), torch.zeros(len(h_img), dtype=torch.bool))


def _eval_axis(length: torch.Tensor, resized: torch.Tensor, size: int) -> Axis:
    step = length.double() / resized.double()
    offset = torch.round((resized - size).double() / 2)       # CenterCrop's int(round((H - size) / 2))
    reach = step.clamp(min=1) + 1                               # the filter's support, and a pixel to spare
    start = torch.floor(offset * step - reach).clamp(min=0).long()
    stop = torch.minimum(torch.ceil((offset + size) * step + reach).long(), length.long())
    return Axis(start, stop - start, -start.double(), step, offset)


def weights(params: torch.Tensor, size: int, padded: int, dtype=torch.float32,
            flip: torch.Tensor | None = None) -> torch.Tensor:
    """(N, size, padded) antialiased bilinear weights of each output pixel over its region's pixels.

    ``params`` is (N, 4) float64 on the device: an ``Axis``'s (src0, step, offset, length) per image.
    ``flip`` (N,) bool: those images' output pixels in reverse order (a horizontal flip, on the column axis).
    """
    device = params.device
    src0, step, offset, length = params.unbind(1)
    i = torch.arange(size, device=device, dtype=torch.float64)[None, :]
    if flip is not None:     # output i of a flipped image is output size-1-i of the unflipped one
        i = torch.where(flip[:, None], size - 1 - i, i)
    # the centres in float64 (N x size numbers), the (N, size, padded) weights in float32: half the memory,
    # and positions of a few thousand pixels keep ~1e-4 pixel of precision
    centre = (src0[:, None] + (i + offset[:, None] + 0.5) * step[:, None]).to(torch.float32)   # (N, size)
    j = torch.arange(padded, device=device, dtype=torch.float32) + 0.5
    inverse = (1 / step.clamp(min=1.0)).to(torch.float32)[:, None, None]                      # the filter's width
    w = (1 - (j[None, None, :] - centre[..., None]).abs_().mul_(inverse)).clamp_(min=0)       # triangle filter
    w.mul_(j[None, None, :] < length.to(torch.float32)[:, None, None])                         # only the region
    return w.div_(w.sum(-1, keepdim=True).clamp_(min=1e-12)).to(dtype)                         # renormalised at edges


def apply(images: list[torch.Tensor], plan: Plan, size: int, *, normalize: bool = True,
          mean=IMAGENET_MEAN, std=IMAGENET_STD, chunk_bytes: int | None = None) -> torch.Tensor:
    """(N, 3, size, size) float32 from N uint8 (3, H, W) images (any sizes, one device) and their ``plan``.

    Values are in [0, 1] (``normalize=False``) or ImageNet-normalised. Images are processed in
    chunks of similar region sizes (at most ``chunk_bytes`` of padded float32 each). Nothing here
    waits for the device: the few per-image numbers travel through pinned memory.
    """
    n = len(images)
    device = images[0].device if n else torch.device("cpu")
    out = torch.empty((n, 3, size, size), dtype=torch.float32, device=device)
    if not n:
        return out
    budget = chunk_bytes or CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"])
    rows_len, cols_len = plan.rows.length.tolist(), plan.cols.length.tolist()
    order = sorted(range(n), key=lambda k: rows_len[k] * cols_len[k])   # similar sizes pad together
    per_image = torch.stack([torch.stack([a.src0, a.step, a.offset, a.length.double()], 1)
                             for a in (plan.rows, plan.cols)] + [plan.flip.double()[:, None].expand(n, 4)])
    per_image = _to(per_image[:, order], device)                        # (3, N, 4), in chunk order
    # normalisation and the way back to the batch's order, fused into one kernel each per chunk
    scale = [1 / 255 / std[c] if normalize else 1 / 255 for c in range(3)]
    shift = [-mean[c] / std[c] if normalize else 0.0 for c in range(3)]
    affine = _to(torch.tensor([scale, shift], dtype=torch.float32).view(2, 1, 3, 1, 1), device)
    back = _to(torch.tensor(order), device)
    start = 0
    while start < n:
        stop, hp, wp = start, 0, 0
        while stop < n:     # grow the chunk while its padded float32 tensor fits the budget
            k = order[stop]
            h2, w2 = max(hp, rows_len[k]), max(wp, cols_len[k])
            if stop > start and (stop - start + 1) * 3 * h2 * w2 * 4 > budget:
                break
            hp, wp, stop = h2, w2, stop + 1
        chunk = _resample(images, plan, order[start:stop], per_image[:, start:stop], size, hp, wp)   # (n, y, c, x)
        out.index_copy_(0, back[start:stop], torch.addcmul(affine[1], chunk.permute(0, 2, 1, 3), affine[0]))
        start = stop
    return out


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without making the host wait (pinned, non-blocking on CUDA)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# On CUDA the region and the weights are float16 (tensor cores, half the bytes): pixels 0..255 are
# exact in it and the weights' relative error (2^-11) moves an output by at most 0.13 of a grey
# level; the products accumulate in float32. The CPU (tests, CPU training) keeps float32.
REGION_DTYPE = {"cuda": torch.float16}


def _resample(images, plan: Plan, chunk: list[int], params: torch.Tensor, size: int, hp: int, wp: int):
    """(n, size, 3, size): the chunk's images resampled, rows x channels x columns (``apply`` reorders them).

    The channels sit between rows and columns so that both products are plain batched matrix products
    of contiguous tensors: with channels first, ``wy`` broadcast over them was copied 3 times per chunk
    (an ``elementwise_kernel`` clone of 0.6 ms per batch, results/gpu_input/pipeline_profile_gather.txt).
    """
    device = images[chunk[0]].device
    dtype = REGION_DTYPE.get(device.type, torch.float32)
    n = len(chunk)
    region = regions(images, plan, chunk, hp, wp).to(dtype)             # (n, hp, 3, wp)
    wy = weights(params[0], size, hp, dtype)                             # (n, size, hp)
    wxt = weights(params[1], size, wp, dtype, flip=params[2, :, 0] > 0.5).transpose(1, 2)   # (n, wp, size)
    # contract the longer input axis first: fewer multiply-adds
    if hp >= wp:
        rows = wy @ region.view(n, hp, 3 * wp)                           # (n, size, 3 * wp)
        return (rows.view(n, size * 3, wp) @ wxt).view(n, size, 3, size)
    cols = region.view(n, hp * 3, wp) @ wxt                              # (n, hp * 3, size)
    return (wy @ cols.view(n, hp, 3 * size)).view(n, size, 3, size)


def regions(images, plan: Plan, chunk: list[int], hp: int, wp: int) -> torch.Tensor:
    """(len(chunk), hp, 3, wp) uint8: each image's crop region (rows, channels, columns), top-left aligned, by one
    gather for the whole chunk.

    A slice copy per image cost a Python call and a kernel launch each (256 per batch, ~4 ms of the
    producer thread's time per batch under cProfile, results/gpu_input/pipeline_profile.txt). Here the
    images' memory is concatenated once (each image viewed in its own memory order: nvjpeg's CHW
    and the loader's HWC views alike, no per-image copy) and one index tensor picks every region pixel.
    Past a region's own rows and columns the index repeats its last row or column: those pixels get
    weight 0 (``weights`` zeroes everything at or past ``length``), so they never reach an output.
    """
    device = images[chunk[0]].device
    parts, rows = [], []
    base = 0
    r0, rl = plan.rows.start.tolist(), plan.rows.length.tolist()
    c0, cl = plan.cols.start.tolist(), plan.cols.length.tolist()
    for k in chunk:
        t = images[k]
        in_memory_order = t.permute(sorted(range(3), key=lambda d: -t.stride(d)))
        if not in_memory_order.is_contiguous():                          # a strided view of something bigger
            t = in_memory_order = t.contiguous()
        parts.append(in_memory_order.reshape(-1))                        # a view: no copy
        rows.append((base, *t.stride(), r0[k], rl[k], c0[k], cl[k]))
        base += t.numel()
    memory = torch.cat(parts) if len(parts) > 1 else parts[0]
    p = _to(torch.from_numpy(np.array(rows, dtype=np.int64)), device)  # (n, 8); torch.tensor(rows) took 2.7 ms
    start, sc, sy, sx = (p[:, j, None, None, None] for j in range(4))
    y = torch.arange(hp, device=device)[None, :, None, None]
    x = torch.arange(wp, device=device)[None, None, None, :]
    y = torch.minimum(y, p[:, 5, None, None, None] - 1) + p[:, 4, None, None, None]    # (n, hp, 1, 1)
    x = torch.minimum(x, p[:, 7, None, None, None] - 1) + p[:, 6, None, None, None]    # (n, 1, 1, wp)
    c = torch.arange(3, device=device)[None, None, :, None]
    index = (start + y * sy + c * sc) + x * sx                           # (n, hp, 3, wp)
    return memory.take(index)
