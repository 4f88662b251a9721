"""The batched image path: read, decode, augment a whole batch on the training device, one batch ahead.

``BatchPipeline.batches(index_batches)`` yields ``(x, y, problems)`` already on the device, in
the order of ``index_batches`` (the sampler's: sharding and sample order are the loader's, not
ours). A background thread prepares batch k+1 while the training step of batch k runs
(``prefetched``); on CUDA its GPU work (nvjpeg, the augmentation's matrix products, the
host-to-device copies) is queued on a side stream, and the training stream waits on an event
recorded after it, so the two overlap on the GPU and the training stream never reads a batch
before it is complete. Per batch:

1. read the samples' bytes (or raw pixels): with loader processes (``--loader-workers N``), a whole
   batch per process into one shared-memory tensor (``read_batch``), so the training process spends
   no time, and takes no GIL, on file reads; without them, in a thread pool. The loader processes
   also decode the first ``cpu_decode`` fraction of the batch's JPEGs (Pillow) into that tensor,
   which the DataLoader's pinning thread pins, and the whole tensor reaches the device in one copy;
2. decode: the other JPEGs by one batched nvjpeg call on the device when a GPU decoder is given, the
   rest (and everything without one) by Pillow in the thread pool, then one host-to-device copy of
   all their pixels through a pinned buffer;
3. crop plan on the CPU (``torch.Generator`` seeded once per pipeline from torch's global
   generator, so each rank's augmentation is reproducible), then ``augment.apply`` on the device.
"""
from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ddtrain.data import augment
from ddtrain.data.decode import ON_CPU, SKIPPED, BadImage, Problem, decode_pillow, kind, split_for_gpu

# batches prepared ahead of the step that uses them: 4 gave 6,148 against depth 2's 6,054 images/s
# with compiled ResNet-50 on one H200 (results/gpu_input/probe_h200.json)
PREFETCH_DEPTH = 4


class BatchPipeline:
    """Batches of an ``ImageDataset`` made on ``device`` (see the module docstring)."""

    def __init__(self, dataset, device: torch.device, *, threads: int = 0, decoder=None, depth: int = PREFETCH_DEPTH,
                 readers: int = 0, cpu_decode: float = 0.0):
        self.dataset, self.device, self.decoder, self.depth = dataset, torch.device(device), decoder, depth
        # nvjpeg's share of the GPU is taken from the training step's: the loader processes' idle cores can
        # decode part of each batch instead (only with loader processes; Pillow, as the CPU path decodes)
        self.cpu_decode = cpu_decode if readers and dataset.encoded else 0.0
        self.threads = threads or min(16, os.cpu_count() or 1)
        # Loader processes that read whole batches. Measured on one H200 with 16 cores (10,000 JPEGs
        # of 83 kB, batch 256): 16 threads of the training process read 6,348 files/s
        # (results/gpu_input/probe_h200.json) and, reading, took the GIL from the thread that
        # launches the training step (the step went from 54 to 87 ms, results/gpu_input/run1.json).
        self.readers = readers
        self.generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))
        self.pin = self.device.type == "cuda"

    def describe(self) -> dict:
        decoder = ("nvjpeg (torchvision.io.decode_jpeg), Pillow for the rest" if self.decoder is not None else
                   "Pillow, in threads" if self.dataset.encoded else "none (raw pixels)")
        return {"pipeline": "gpu" if self.device.type == "cuda" else f"batched on {self.device.type}",
                "decoder": decoder, "augment": f"batched on {self.device.type} (ddtrain.data.augment)",
                "threads": self.threads, "reader_processes": self.readers, "prefetch_batches": self.depth,
                "cpu_decode": self.cpu_decode, "option": self.dataset.pipeline}

    def batches(self, index_batches):
        if not self.readers:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="ddtrain-read") as pool:
                yield from prefetched(index_batches, lambda idx: self.make(idx, pool), self.device, self.depth)
            return
        from torch.utils.data import DataLoader
        lists = [[int(i) for i in idx] for idx in index_batches]
        loader = DataLoader(_BatchReader(self.dataset, self.cpu_decode), sampler=lists, batch_size=None,
                            num_workers=self.readers, collate_fn=_as_is, prefetch_factor=2, persistent_workers=False,
                            pin_memory=self.pin)   # ReadBatch.pin_memory: the whole batch pinned off this thread
        # the few images Pillow decodes (not JPEGs) and the pinned copies: a small pool
        with ThreadPoolExecutor(min(4, self.threads), thread_name_prefix="ddtrain-decode") as pool:
            yield from prefetched(iter(loader), lambda got: self.make(got[0], pool, got[1]), self.device, self.depth)

    # -- one batch ---------------------------------------------------------------------
    def make(self, idx, pool, read=None) -> tuple[torch.Tensor, torch.Tensor, list[Problem]]:
        """Batch ``idx``; ``read`` is what a loader process read of it (``read_batch``), else it is read here."""
        ds = self.dataset
        idx = [int(i) for i in idx]
        items = list(pool.map(self._read, idx)) if read is None else read.items(ds)
        labels = [int(ds.labels[i]) for i in idx]
        problems: list[Problem] = [x for x in items if isinstance(x, Problem)]
        images: list = [None] * len(idx)
        arrays: dict[int, np.ndarray] = {}
        if read is not None:   # pixels the loader process read or decoded: views of one copy of its tensor
            for k, t in read.pixels_on(self.device).items():
                images[k] = t
        if ds.encoded:
            pending = [k for k, x in enumerate(items) if not isinstance(x, Problem) and images[k] is None]
            on_gpu, to_cpu = (split_for_gpu([items[k] for k in pending]) if self.decoder is not None
                              else ([], [(j, None) for j in range(len(pending))]))
            on_gpu = [pending[j] for j in on_gpu]
            to_cpu = [(pending[j], why) for j, why in to_cpu]
            for k, decoded in zip(on_gpu, self._decode_gpu([items[k] for k in on_gpu], [idx[k] for k in on_gpu])):
                if isinstance(decoded, torch.Tensor):
                    images[k] = decoded
                else:                     # nvjpeg failed on this one: Pillow's turn, the reason kept
                    to_cpu.append((k, decoded))
            for (k, why), decoded in zip(to_cpu, pool.map(self._decode_cpu, [items[k] for k, _ in to_cpu],
                                                            [idx[k] for k, _ in to_cpu])):
                if isinstance(decoded, Problem):
                    problems.append(decoded)
                else:
                    arrays[k] = decoded
                    if why is not None:
                        problems.append(Problem(ds.name(idx[k]), why, ON_CPU))
        else:
            arrays = {k: x for k, x in enumerate(items) if not isinstance(x, Problem) and images[k] is None}
        for k, t in self._upload(arrays, pool).items():
            images[k] = t
        images, labels, problems = fill_skipped(
            images, labels, problems, lambda: torch.zeros((3, ds.size, ds.size), dtype=torch.uint8, device=self.device))
        heights = torch.tensor([t.shape[1] for t in images])
        widths = torch.tensor([t.shape[2] for t in images])
        plan = augment.plan(heights, widths, ds.size, ds.train, self.generator)
        x = augment.apply(images, plan, ds.size, normalize=ds.normalize)
        y = torch.tensor(labels, dtype=torch.long)
        y = y.pin_memory().to(self.device, non_blocking=True) if self.pin else y.to(self.device)
        return x, y, problems

    def _read(self, i: int):
        try:
            return self.dataset.read(i)
        except OSError as exc:
            return Problem(self.dataset.name(i), f"cannot be read ({exc.strerror or exc})", SKIPPED)

    def _decode_cpu(self, data, i: int):
        try:
            return decode_pillow(data)
        except BadImage as exc:
            return Problem(self.dataset.name(i), str(exc), SKIPPED)

    def _decode_gpu(self, blobs: list, idx: list[int]) -> list:
        """CHW uint8 device tensors, or for each image nvjpeg failed on, the reason (Pillow decodes it)."""
        if not blobs:
            return []
        tensors = [torch.from_numpy(np.frombuffer(b, dtype=np.uint8)) if not isinstance(b, torch.Tensor) else b
                   for b in blobs]
        try:
            return list(self.decoder(tensors, self.device))
        except Exception:         # one bad image fails the whole batched call: find it one by one
            out = []
            for t in tensors:
                try:
                    out.append(self.decoder([t], self.device)[0])
                except Exception as exc:
                    out.append(f"nvjpeg could not decode it ({str(exc).strip().splitlines()[0][:120]})")
            return out

    def _upload(self, arrays: dict[int, np.ndarray], pool) -> dict[int, torch.Tensor]:
        """(H, W, 3) uint8 host arrays -> (3, H, W) tensors on the device: one pinned buffer, one copy."""
        if not arrays:
            return {}
        if self.device.type == "cpu":
            return {k: torch.from_numpy(np.ascontiguousarray(a) if a.flags.writeable else a.copy()).permute(2, 0, 1)
                    for k, a in arrays.items()}
        keys = list(arrays)
        sizes = [arrays[k].size for k in keys]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        flat = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=self.pin)
        host = flat.numpy()

        def put(j):
            host[offsets[j]:offsets[j + 1]] = arrays[keys[j]].reshape(-1)
        list(pool.map(put, range(len(keys))))
        on_device = flat.to(self.device, non_blocking=True)
        return {k: on_device[offsets[j]:offsets[j + 1]].view(arrays[k].shape).permute(2, 0, 1)
                for j, k in enumerate(keys)}


class ReadBatch:
    """One batch as a loader process read it: every sample's bytes (or pixels) in one uint8 tensor.

    One tensor travels between processes through shared memory (torch's multiprocessing), where a
    list of byte strings would be pickled through a pipe and copied again by the training process.
    """

    def __init__(self, flat: torch.Tensor, sizes: list[int], shapes: list, unreadable: dict[int, tuple[str, str]]):
        self.flat, self.sizes, self.shapes, self.unreadable = flat, sizes, shapes, unreadable

    def pin_memory(self):
        """The DataLoader's pinning thread calls this (``pin_memory=True``): one pinned copy of the whole batch."""
        self.flat = self.flat.pin_memory()
        return self

    def pixels_on(self, device: torch.device) -> dict[int, torch.Tensor]:
        """{sample: (3, H, W) uint8 view} of every sample held as pixels, from one copy of the tensor to ``device``."""
        if not any(shape is not None for shape in self.shapes):
            return {}
        flat = self.flat.to(device, non_blocking=self.flat.is_pinned())
        out, start = {}, 0
        for k, (size, shape) in enumerate(zip(self.sizes, self.shapes)):
            if shape is not None and k not in self.unreadable:
                out[k] = flat[start:start + size].view(shape).permute(2, 0, 1)
            start += size
        return out

    def items(self, dataset) -> list:
        """Per sample: its bytes (or (H, W, 3) pixels) as a numpy view of the shared tensor, or a Problem."""
        data, out, start = self.flat.numpy(), [], 0
        for k, (size, shape) in enumerate(zip(self.sizes, self.shapes)):
            if k in self.unreadable:
                out.append(Problem(*self.unreadable[k], SKIPPED))
                continue
            view = data[start:start + size]
            out.append(view if shape is None else view.reshape(shape))
            start += size
        return out


def read_batch(dataset, idx: list[int], cpu_decode: float = 0.0) -> ReadBatch:
    """Read samples ``idx`` of ``dataset`` (in a loader process) into one ``ReadBatch``; the first
    ``round(cpu_decode * len(idx))`` plain JPEGs are decoded here (Pillow), the rest stay bytes."""
    parts, sizes, shapes, unreadable = [], [], [], {}
    to_decode = round(cpu_decode * len(idx)) if dataset.encoded else 0
    for k, i in enumerate(idx):
        try:
            item = np.asarray(dataset.read(i), dtype=np.uint8)
        except OSError as exc:
            unreadable[k] = (dataset.name(i), f"cannot be read ({exc.strerror or exc})")
            sizes.append(0)
            shapes.append(None)
            continue
        shape = None if dataset.encoded else tuple(item.shape)
        if to_decode and kind(item) == "jpeg":   # anything else keeps its bytes: the training process routes it
            try:
                item = decode_pillow(item)
                shape, to_decode = item.shape, to_decode - 1
            except BadImage:                      # nvjpeg, then Pillow again there, name its problem
                pass
        parts.append(item.reshape(-1))
        sizes.append(item.size)
        shapes.append(shape)
    flat = torch.from_numpy(np.concatenate(parts) if parts else np.empty(0, np.uint8))
    return ReadBatch(flat, sizes, shapes, unreadable)


class _BatchReader:
    """What the loader processes run: a batch of indices in, its ``ReadBatch`` out (picklable)."""

    def __init__(self, dataset, cpu_decode: float = 0.0):
        self.dataset, self.cpu_decode = dataset, cpu_decode

    def __getitem__(self, idx):
        return list(idx), read_batch(self.dataset, idx, self.cpu_decode)

    def __len__(self):
        return len(self.dataset)


def _as_is(item):
    return item


def fill_skipped(images: list, labels: list, problems: list[Problem], blank):
    """(images, labels, problems) with each skipped sample (``None``) replaced by the next good one of the batch.

    The replacement (image and label, taken cyclically from the batch's good samples) keeps the
    batch's size, so compiled graphs and batch norm see the shape they expect. A batch with no
    good sample at all gets ``blank()`` images (zeros), and its problems say so.
    """
    good = [k for k, t in enumerate(images) if t is not None]
    if len(good) == len(images):
        return images, labels, problems
    if not good:
        problems = [Problem(p.file, p.reason, SKIPPED + ", every image of its batch unreadable: zeros trained in "
                            "their place") if p.action == SKIPPED else p for p in problems]
        return [blank()] * len(images), labels, problems
    images, labels = list(images), list(labels)
    for n, k in enumerate([k for k, t in enumerate(images) if t is None]):
        images[k], labels[k] = images[good[n % len(good)]], labels[good[n % len(good)]]
    return images, labels, problems


def prefetched(items, make, device: torch.device, depth: int = PREFETCH_DEPTH):
    """``make(item)`` for each of ``items``, in order, computed in a background thread up to ``depth`` ahead.

    On CUDA, ``make`` runs on a side stream; each result is handed over after the current
    stream has been made to wait for it (an event) and its tensors are marked as used there
    (``record_stream``: the allocator must not reuse their memory while the step still reads
    them). An exception in ``make`` is raised here, in the consumer, at that item.
    """
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce():
        try:
            if cuda:
                torch.cuda.set_device(device)
            for item in items:
                if stop.is_set():
                    return
                if cuda:
                    with torch.cuda.stream(side):
                        result = make(item)
                        event = side.record_event()
                else:
                    result, event = make(item), None
                if not put((result, event)):
                    return
            put(None)
        except BaseException as exc:   # handed to the consumer, raised there
            put(exc)

    worker = threading.Thread(target=produce, name="ddtrain-batches", daemon=True)
    worker.start()
    try:
        while True:
            got = ready.get()
            if got is None:
                return
            if isinstance(got, BaseException):
                raise got
            result, event = got
            if event is not None:
                current = torch.cuda.current_stream(device)
                current.wait_event(event)
                for t in result if isinstance(result, tuple) else (result,):
                    if isinstance(t, torch.Tensor):
                        t.record_stream(current)
            yield result
    finally:
        stop.set()
        worker.join(timeout=30)
