"""``packed:DIR``: an image set packed into a few large shard files (``ddtrain data pack``), and its packer.

Layout of DIR (docs/DATA.md has the full description):

* ``shard-00000.bin``, ...: the samples' bytes back to back, in the source's sample order:
  (H, W, 3) uint8 RGB pixels (``encoding: raw``) or one JPEG file each (``encoding: jpeg``);
* ``shard-00000.index.json``: per sample of that shard, columns ``offset``, ``nbytes``,
  ``height``, ``width``, ``label``, ``file`` (the source file, relative to the source folder);
* ``manifest.json``, written last and atomically: format and version, encoding, ``max_side``,
  the class names (index = label), the sample count, per shard its files, sample count, bytes
  and the sha256 of the shard and of its index, and the files the packer skipped.

Images whose longer side exceeds ``max_side`` are scaled down (antialiased bilinear, aspect
kept) so that it is ``max_side``; 0 keeps every image's size. ``raw`` costs H*W*3 bytes a
sample and no decode; ``jpeg`` keeps a source JPEG's own bytes when it needs no resize and no
conversion (1- or 3-component JPEG), else re-encodes at ``quality``: smaller, decoded by nvjpeg
on the GPU path.

Reading maps the shards (``numpy.memmap``, opened lazily in each process), so the loader
processes of a node, and the nodes reading one shared file system, share the page cache.
Opening the set checks every shard's size and (``verify=full``, the default) its sha256, in
threads: a shard that fails is named and refused before training starts.

Packing is resumable: each finished shard is recorded in ``.pack-progress.json`` (with its
checksums) and packing again with the same options continues after the last finished shard;
a shard being written is ``*.partial`` until it is complete, and the manifest appears only at
the end, so an interrupted run never leaves a set that looks finished.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddtrain.data.decode import SKIPPED, BadImage, Problem, decode_pillow, kind
from ddtrain.data.images import ImageDataset, pipeline_option
from ddtrain.data.transforms import bool_option, int_option
from ddtrain.errors import DDTrainError

FORMAT, VERSION = "ddtrain-packed", 1
MANIFEST, PROGRESS = "manifest.json", ".pack-progress.json"
ENCODINGS = ("raw", "jpeg")
COLUMNS = ("offset", "nbytes", "height", "width", "label")
HASH_CHUNK = 8 << 20


# ---------------------------------------------------------------------------- reading

@dataclass
class PackedDataset(ImageDataset):
    """The samples of a packed set: index columns in memory, bytes mapped from the shards when read."""

    root: Path = Path(".")
    encoding: str = "raw"
    shard_files: list[str] = field(default_factory=list)
    shard: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    offset: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    nbytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    height: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    width: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    files: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._maps: dict[int, np.memmap] = {}

    @property
    def encoded(self) -> bool:
        return self.encoding == "jpeg"

    def __getstate__(self):   # maps are opened anew in each process (a memmap would pickle as a copy)
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state

    def _map(self, k: int) -> np.memmap:
        if k not in self._maps:
            # copy-on-write: writable views for torch, never written back, still the shared page cache
            self._maps[k] = np.memmap(self.root / self.shard_files[k], dtype=np.uint8, mode="c")
        return self._maps[k]

    def read(self, i: int):
        start = int(self.offset[i])
        data = self._map(int(self.shard[i]))[start:start + int(self.nbytes[i])]
        return data if self.encoded else data.reshape(int(self.height[i]), int(self.width[i]), 3)

    def name(self, i: int) -> str:
        return f"{self.root / self.shard_files[int(self.shard[i])]} ({self.files[i]})"

    def _take(self, idx: np.ndarray) -> dict:
        return {"shard": self.shard[idx], "offset": self.offset[idx], "nbytes": self.nbytes[idx],
                "height": self.height[idx], "width": self.width[idx], "files": [self.files[j] for j in idx]}


def load_packed(path: str, *, size=224, augment=True, normalize=True, pipeline="auto", verify="full"):
    """``packed:DIR`` (made by ``ddtrain data pack``) with options:

    size       side of the square images the model sees (default 224)
    augment    random-resized-crop + flip for training samples (false: eval transform for all)
    normalize  subtract ImageNet's channel means and divide by its stds (default true)
    pipeline   auto, gpu or cpu: where images are decoded and augmented (ddtrain.data.images)
    verify     full (every shard's sha256, checked in threads when the set is opened) or size (sizes only)
    """
    root = Path(path)
    if verify not in ("full", "size"):
        raise DDTrainError(f"packed: option verify={verify!r} is not one of: full, size")
    manifest = read_manifest(root)
    check_shards(root, manifest, full=verify == "full")
    columns = {name: [] for name in (*COLUMNS, "file", "shard")}
    for k, entry in enumerate(manifest["shards"]):
        index = _read_index(root, entry)
        for name in (*COLUMNS, "file"):
            columns[name] += index[name]
        columns["shard"] += [k] * entry["samples"]
    arrays = {name: np.asarray(columns[name], dtype=np.int64) for name in (*COLUMNS, "shard")}
    _check_index(root, manifest, arrays)
    return PackedDataset(classes=list(manifest["classes"]), labels=arrays["label"], root=root,
                         encoding=manifest["encoding"], shard_files=[e["file"] for e in manifest["shards"]],
                         shard=arrays["shard"], offset=arrays["offset"], nbytes=arrays["nbytes"],
                         height=arrays["height"], width=arrays["width"], files=columns["file"],
                         size=int_option("size", size, minimum=8, fmt="packed"),
                         train=bool_option("augment", augment, fmt="packed"),
                         normalize=bool_option("normalize", normalize, fmt="packed"),
                         pipeline=pipeline_option(pipeline, "packed"))


def read_manifest(root: Path) -> dict:
    if not root.is_dir():
        raise DDTrainError(f"packed: {root} is a file, not a packed folder" if root.exists() else
                           f"packed: {root} does not exist")
    path = root / MANIFEST
    if not path.is_file():
        hint = (" (packing did not finish: run `ddtrain data pack` again with the same arguments to resume)"
                if (root / PROGRESS).exists() else " (make one with: ddtrain data pack SRC_DIR OUT_DIR)")
        raise DDTrainError(f"packed: {root} is not a finished packed set: it has no {MANIFEST}{hint}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DDTrainError(f"packed: {path} cannot be read as JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DDTrainError(f"packed: {path} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise DDTrainError(f"packed: {path} is version {manifest.get('version')}; this ddtrain reads version "
                           f"{VERSION} (pack the images again)")
    for name in ("encoding", "classes", "samples", "shards"):
        if name not in manifest:
            raise DDTrainError(f"packed: {path} has no {name!r}")
    if manifest["encoding"] not in ENCODINGS:
        raise DDTrainError(f"packed: {path}: unknown encoding {manifest['encoding']!r}")
    return manifest


def check_shards(root: Path, manifest: dict, *, full: bool = True) -> None:
    """Refuse, naming it, the first shard that is missing, of the wrong size or (``full``) fails its sha256."""
    for entry in manifest["shards"]:
        path = root / entry["file"]
        if not path.is_file():
            raise DDTrainError(f"packed: shard {path} is missing (the manifest lists it)")
        if path.stat().st_size != entry["bytes"]:
            raise DDTrainError(f"packed: shard {path} has {path.stat().st_size} bytes; the manifest says "
                               f"{entry['bytes']}: the file is damaged or from another packing; refused")
    if not full:
        return
    shards = manifest["shards"]
    with ThreadPoolExecutor(min(8, max(1, len(shards)))) as pool:   # hashlib releases the GIL
        for entry, digest in zip(shards, pool.map(lambda e: sha256_file(root / e["file"]), shards)):
            if digest != entry["sha256"]:
                raise DDTrainError(f"packed: shard {root / entry['file']} fails its checksum (sha256 {digest[:16]}..., "
                                   f"the manifest says {entry['sha256'][:16]}...): the file is damaged; refused "
                                   f"(pack the images again, or restore the shard)")


def _read_index(root: Path, entry: dict) -> dict:
    path = root / entry["index"]
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DDTrainError(f"packed: index {path} cannot be read ({exc.strerror})") from None
    if hashlib.sha256(raw).hexdigest() != entry["index_sha256"]:
        raise DDTrainError(f"packed: index {path} fails its checksum: the file is damaged; refused")
    index = json.loads(raw)
    if any(len(index.get(name, ())) != entry["samples"] for name in (*COLUMNS, "file")):
        raise DDTrainError(f"packed: index {path} does not list {entry['samples']} samples in every column")
    return index


def _check_index(root: Path, manifest: dict, a: dict) -> None:
    n = len(a["label"])
    if n != manifest["samples"] or n == 0:
        raise DDTrainError(f"packed: {root} lists {n} samples; the manifest says {manifest['samples']}")
    if a["label"].min() < 0 or a["label"].max() >= len(manifest["classes"]):
        raise DDTrainError(f"packed: {root} has labels outside 0..{len(manifest['classes']) - 1}")
    sizes = np.asarray([e["bytes"] for e in manifest["shards"]], dtype=np.int64)[a["shard"]]
    if (a["offset"] < 0).any() or (a["offset"] + a["nbytes"] > sizes).any() or (a["nbytes"] <= 0).any():
        raise DDTrainError(f"packed: {root}: an index entry points outside its shard")
    if manifest["encoding"] == "raw" and (a["nbytes"] != a["height"] * a["width"] * 3).any():
        raise DDTrainError(f"packed: {root}: a raw sample's byte count is not height x width x 3")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------- packing

@dataclass(frozen=True)
class PackOptions:
    max_side: int = 512          # longer side at most this (0: keep sizes)
    encoding: str = "raw"
    quality: int = 90            # JPEG quality of re-encoded images
    shard_bytes: int = 512 << 20

    def check(self) -> None:
        if self.encoding not in ENCODINGS:
            raise DDTrainError(f"pack: --encode {self.encoding!r} is not one of: {', '.join(ENCODINGS)}")
        if self.max_side < 0 or 0 < self.max_side < 8:
            raise DDTrainError(f"pack: --max-side {self.max_side} must be 0 (keep sizes) or at least 8")
        if not 1 <= self.quality <= 100:
            raise DDTrainError(f"pack: --quality {self.quality} must be in 1..100")
        if self.shard_bytes < 1 << 20:
            raise DDTrainError(f"pack: shards of {self.shard_bytes} bytes are too small (at least 1 MiB)")


def prepare(path: str, options: PackOptions):
    """One source file -> (payload bytes, height, width), or the reason it is skipped (a string)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        pixels = decode_pillow(data)
    except BadImage as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    height, width = pixels.shape[:2]
    resized = options.max_side and max(height, width) > options.max_side
    if resized:
        from PIL import Image
        scale = options.max_side / max(height, width)
        width, height = max(1, round(width * scale)), max(1, round(height * scale))
        pixels = np.asarray(Image.fromarray(pixels).resize((width, height), Image.BILINEAR))
    if options.encoding == "raw":
        return np.ascontiguousarray(pixels).tobytes(), height, width
    if not resized and kind(data) == "jpeg":
        return data, height, width          # the source's own JPEG: no second lossy step
    import io
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=options.quality)
    return buffer.getvalue(), height, width


def _prepare_many(paths: list[str], options: PackOptions) -> list:
    return [prepare(p, options) for p in paths]


def pack(source: str, out: str, options: PackOptions, *, split: str = "auto", workers: int = 0,
         progress: Callable[[int, int], None] | None = None, report: Callable[[Problem], None] | None = None) -> dict:
    """Pack the image folder ``source`` (``DIR`` or ``imagefolder:DIR``) into ``out``; returns the manifest.

    ``progress(done, total)`` is called as samples are written, ``report(problem)`` once per
    skipped file. Resumes an interrupted packing of the same source with the same options.
    """
    from ddtrain.data.imagefolder import load_imagefolder
    options.check()
    folder = source.split(":", 1)[1] if source.startswith("imagefolder:") else source
    if ":" in source and not source.startswith("imagefolder:"):
        raise DDTrainError(f"pack: {source!r}: only image folders are packed (imagefolder:DIR or DIR); the other "
                           f"formats are arrays in memory already, or volumes nvjpeg does not decode")
    dataset = load_imagefolder(folder, split=split, pipeline="cpu")
    report = report or (lambda p: None)
    paths = [str(dataset.root / f) for f in dataset.files]
    root = Path(out)
    setup = {"format": FORMAT, "version": VERSION, "options": options.__dict__,
             "source": {"folder": str(Path(folder).resolve()), "split": split, "root": str(dataset.root.resolve()),
                        "digest": _digest(dataset.classes, dataset.files, dataset.labels)}}
    state = _start(root, setup)
    for p in dataset.scan_problems:
        if p.file not in {s["file"] for s in state["skipped"]}:
            state["skipped"].append({"file": p.file, "reason": p.reason})
            report(p)
    total, done = len(paths), state["next"]
    if progress:
        progress(done, total)
    writer = _ShardWriter(root, len(state["shards"]), options.shard_bytes)
    window = max(1, workers or os.cpu_count() or 1) * 32
    try:
        with ProcessPoolExecutor(max(1, workers or os.cpu_count() or 1)) as pool:
            while done < total:
                chunk = list(range(done, min(total, done + window)))
                groups = [chunk[k:k + 8] for k in range(0, len(chunk), 8)]
                results = [r for group in pool.map(_prepare_many, [[paths[i] for i in g] for g in groups],
                                                    [options] * len(groups)) for r in group]
                for i, result in zip(chunk, results):
                    if isinstance(result, str):
                        state["skipped"].append({"file": paths[i], "reason": result, "position": i})
                        report(Problem(paths[i], result, SKIPPED))
                    else:
                        payload, height, width = result
                        writer.add(payload, height, width, int(dataset.labels[i]), dataset.files[i])
                    done = i + 1
                    if writer.full():
                        state["shards"].append(writer.close(done))
                        state["next"] = done
                        _write_json(root / PROGRESS, state)
                if progress:
                    progress(done, total)
        if writer.count:
            state["shards"].append(writer.close(done))
        state["next"] = done
        _write_json(root / PROGRESS, state)
    finally:
        writer.abandon()   # a shard still open (an error, Ctrl-C) is removed: only whole shards remain
    samples = sum(s["samples"] for s in state["shards"])
    if not samples:
        raise DDTrainError(f"pack: no image of {folder} could be decoded; nothing packed")
    manifest = {"format": FORMAT, "version": VERSION, "encoding": options.encoding, "max_side": options.max_side,
                "max_side_rule": "the longer side of every image is at most max_side (0: sizes kept)",
                "quality": options.quality if options.encoding == "jpeg" else None,
                "classes": list(dataset.classes), "samples": samples, "shards": state["shards"],
                "skipped": state["skipped"], "source": setup["source"]}
    _write_json(root / MANIFEST, manifest)
    (root / PROGRESS).unlink()
    return manifest


def _digest(classes, files, labels) -> str:
    digest = hashlib.sha256(json.dumps(list(classes)).encode())
    for f, label in zip(files, labels.tolist()):
        digest.update(f"{f}\t{label}\n".encode())
    return digest.hexdigest()


def _start(root: Path, setup: dict) -> dict:
    """The packing state: a fresh one, or the recorded one of an interrupted packing (its shards re-checked)."""
    if (root / MANIFEST).exists():
        raise DDTrainError(f"pack: {root} already holds a finished packed set ({MANIFEST}); remove it or "
                           f"choose another folder")
    for stale in root.glob("*.partial") if root.is_dir() else ():
        stale.unlink()           # a shard or file an interrupted run was writing
    progress = root / PROGRESS
    if not progress.exists():
        if root.exists() and any(root.iterdir()):
            raise DDTrainError(f"pack: {root} is not empty and holds no packing in progress; choose an empty "
                               f"or new folder")
        root.mkdir(parents=True, exist_ok=True)
        return {**setup, "shards": [], "skipped": [], "next": 0}
    state = json.loads(progress.read_text())
    for key in ("options", "source"):
        if state.get(key) != setup[key]:
            differs = sorted(k for k in {**state.get(key, {}), **setup[key]}
                             if state.get(key, {}).get(k) != setup[key].get(k))
            raise DDTrainError(f"pack: {root} holds an interrupted packing with other {key} ({', '.join(differs)} "
                               f"differ): pack with the same arguments to resume, or into another folder")
    kept = []
    for entry in state["shards"]:   # a shard damaged since it was recorded is packed again, with all after it
        shard, index = root / entry["file"], root / entry["index"]
        if not (shard.is_file() and index.is_file() and shard.stat().st_size == entry["bytes"]
                and sha256_file(shard) == entry["sha256"] and sha256_file(index) == entry["index_sha256"]):
            break
        kept.append(entry)
    if len(kept) < len(state["shards"]):
        for entry in state["shards"][len(kept):]:
            for name in (entry["file"], entry["index"]):
                (root / name).unlink(missing_ok=True)
        state["next"] = kept[-1]["next"] if kept else 0
        state["skipped"] = [s for s in state["skipped"] if s.get("position", -1) < state["next"]]
        state["shards"] = kept
    return state


class _ShardWriter:
    """Writes one shard at a time as ``*.partial``, renamed when whole (fsync first), with its index."""

    def __init__(self, root: Path, number: int, shard_bytes: int):
        self.root, self.number, self.shard_bytes = root, number, shard_bytes
        self.file = None

    def _open(self):
        self.name = f"shard-{self.number:05d}.bin"
        self.file = open(self.root / (self.name + ".partial"), "wb")
        self.digest, self.size, self.count = hashlib.sha256(), 0, 0
        self.index = {name: [] for name in (*COLUMNS, "file")}

    count = 0

    def add(self, payload: bytes, height: int, width: int, label: int, file: str) -> None:
        if self.file is None:
            self._open()
        self.file.write(payload)
        self.digest.update(payload)
        for name, value in zip((*COLUMNS, "file"), (self.size, len(payload), height, width, label, file)):
            self.index[name].append(value)
        self.size += len(payload)
        self.count += 1

    def full(self) -> bool:
        return self.file is not None and self.size >= self.shard_bytes

    def close(self, next_position: int) -> dict:
        """Finish the shard; ``next_position`` is the source position packing goes on from after it."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.file = None
        os.replace(self.root / (self.name + ".partial"), self.root / self.name)
        index_name = f"shard-{self.number:05d}.index.json"
        raw = json.dumps(self.index).encode()
        _write_bytes(self.root / index_name, raw)
        entry = {"file": self.name, "index": index_name, "samples": self.count, "bytes": self.size,
                 "sha256": self.digest.hexdigest(), "index_sha256": hashlib.sha256(raw).hexdigest(),
                 "next": next_position}
        self.number += 1
        self.count = 0
        return entry

    def abandon(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
            (self.root / (self.name + ".partial")).unlink(missing_ok=True)


def _write_bytes(path: Path, raw: bytes) -> None:
    """Write atomically: a partial file, fsync, rename (a reader sees the old file or the whole new one)."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def _write_json(path: Path, data: dict) -> None:
    _write_bytes(path, json.dumps(data, indent=1).encode())
