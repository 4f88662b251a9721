"""What a compressor remembers between steps, per bucket for the arithmetic and per tensor for checkpoints.

The arithmetic wants one flat buffer per bucket (the error feedback added to the bucket in one
``add_``, PowerSGD's Q matrices all-reduced in one message), but a checkpoint must not depend on
how DDP cut the model into buckets: a restarted DDP trains its first step with its initial
buckets (parameters in reverse order) and later ones with the buckets it rebuilt from the order
gradients became ready, which the run being resumed had used all along. So ``BucketMemory``
keeps each bucket's buffer with its layout (which tensors, how many elements each) and hands
out, and takes back, its pieces per tensor: a bucket asked for with another layout than it
holds is reassembled from its tensors' pieces.

A tensor is named by a key the caller gives: DDP's hook passes each parameter's position in the
model (``model.parameters()``), so the same key names the same parameter in every process and at
every world size; a direct caller without keys gets ``(bucket, i)`` for the i-th tensor.
"""
from __future__ import annotations

import torch

Layout = tuple  # ((tensor key, elements), ...) in buffer order


class BucketMemory:
    """One remembered quantity (an error, a Q) of every bucket: flat buffers, saved and restored per tensor."""

    def __init__(self):
        self.flat: dict = {}      # bucket key -> its flat buffer
        self.layout: dict = {}    # bucket key -> Layout of that buffer
        self.loose: dict = {}     # tensor key -> its piece, held outside any bucket (restored, or its bucket rebuilt)

    def get(self, key, layout: Layout, like: torch.Tensor, *, zeros: bool = False) -> torch.Tensor | None:
        """Bucket ``key``'s buffer for the tensors of ``layout``, on ``like``'s device and dtype.

        A tensor with no piece remembered makes it None, or with ``zeros`` a buffer whose piece
        for that tensor is zeros (an error feedback starts at zero).
        """
        if self.layout.get(key) == layout:
            return self.flat[key]
        held = {k for pieces in self.layout.values() for k, _ in pieces}
        if key in self.layout or any(k in held for k, _ in layout):   # DDP rebuilt its buckets: back to pieces
            self._spill()
        known = [k in self.loose and self.loose[k].numel() == n for k, n in layout]
        if not (layout and all(known)) and not zeros:
            return None
        if any(known):
            buffer = torch.cat([self.loose.pop(k).reshape(-1) if ok else torch.zeros(n, dtype=like.dtype)
                                for (k, n), ok in zip(layout, known)]).to(device=like.device, dtype=like.dtype)
        else:
            buffer = torch.zeros_like(like)
        self.set(key, layout, buffer)
        return buffer

    def set(self, key, layout: Layout, buffer: torch.Tensor) -> None:
        """Remember ``buffer`` as bucket ``key``'s, laid out as ``layout``."""
        if self.layout.get(key, layout) != layout:
            self._spill()
        for k, _ in layout:
            self.loose.pop(k, None)
        self.flat[key], self.layout[key] = buffer, layout

    def _spill(self) -> None:
        """Every bucket's buffer into per-tensor pieces (DDP rebuilt its buckets: every layout changes at once)."""
        for key, buffer in self.flat.items():
            self.loose.update(_pieces(buffer, self.layout[key]))
        self.flat.clear()
        self.layout.clear()

    def clear(self) -> None:
        self.flat.clear()
        self.layout.clear()
        self.loose.clear()

    def state_dict(self) -> dict:
        """{tensor key: its piece (a copy)}: the same for every bucket layout."""
        out = {k: v.detach().clone() for k, v in self.loose.items()}
        for key, buffer in self.flat.items():
            out.update({k: v.detach().clone() for k, v in _pieces(buffer, self.layout[key]).items()})
        return out

    def load_state_dict(self, pieces: dict) -> None:
        """Forget everything and hold ``pieces`` (``state_dict()``'s) until buckets ask for them."""
        self.clear()
        self.loose.update({k: v.detach().clone() for k, v in pieces.items()})


def _pieces(buffer: torch.Tensor, layout: Layout) -> dict:
    out, at = {}, 0
    for key, n in layout:
        out[key] = buffer[at:at + n]
        at += n
    return out


def tensor_keys(key, count: int, keys=None) -> list:
    """The keys of a bucket's ``count`` tensors: ``keys`` as given, else ``(key, i)``."""
    if keys is None:
        return [(key, i) for i in range(count)]
    keys = list(keys)
    if len(keys) != count:
        raise ValueError(f"compression: {len(keys)} tensor keys for {count} tensors")
    return keys


def mean_pieces(states: list[dict]) -> dict:
    """The element-wise mean of several ranks' pieces (tensor key -> tensor), over the keys every rank has."""
    common = set(states[0]).intersection(*states[1:]) if states else set()
    return {k: torch.stack([s[k] for s in states]).mean(0).to(states[0][k].dtype) for k in states[0] if k in common}


def check_pieces(pieces: dict, shapes: dict | None, elements, what: str) -> None:
    """ValueError unless every piece names a tensor of ``shapes`` and has ``elements(shape)`` elements (None: unknown)."""
    if shapes is None:
        return
    for key, piece in pieces.items():
        if key not in shapes:
            raise ValueError(f"its {what} names tensor {key!r}, which the model does not have")
        want = elements(shapes[key])
        if want is None or piece.numel() != want:
            raise ValueError(f"its {what} of tensor {key!r} has {piece.numel()} elements where this model and "
                             f"method keep {want or 0}")
