"""``powersgd:RANK[:WARMUP_STEPS]``: PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019), as PyTorch's ``powerSGD_hook``.

Each gradient tensor is viewed as a matrix M (n = its first dimension, m = the rest). Those
where rank-r factors save at least half -- ``(n + m)·r·2 < n·m``, torch's ``min_compression_rate``
of 2 -- are compressed; the others (biases, norms, small layers) are averaged uncompressed, in
one all-reduce per buffer. For the compressed ones, with error feedback (the part of the last
step's gradient that the approximation missed is added to this step's) and a warm start (Q is
reused from the last step, the paper's single power-iteration step):

1. P = M Q; all-reduce the P of every matrix (a sum);
2. orthogonalise each P's columns (Gram-Schmidt, as the paper's Algorithm 1);
3. Q = Mᵀ P; all-reduce every Q and divide by R;
4. M ≈ P Qᵀ, and the error M_in - P Qᵀ is kept for the next step.

Q starts from a normal draw, orthogonalised, the same on every rank (a seeded generator). The
first WARMUP_STEPS steps (default 10; at least 2 because DDP rebuilds its buckets after the
first step) are averaged uncompressed, torch's ``start_powerSGD_iter``. The arithmetic follows
torch's hook line by line (``torch.bmm`` per matrix, torch's seed sequence), so for ranks <= 2,
where torch orthogonalises by Gram-Schmidt too, it reaches torch's update bit for bit on two
ranks (tests/comm/test_compression_powersgd.py); for larger ranks torch switches to a QR
factorisation, which can differ from Gram-Schmidt in the sign of columns and the last bits.

Bytes per step after the warm-up: the all-reduces of Σ(n+m)·r elements (the compressed
matrices) plus the uncompressed elements, so ``2(R-1)/R·(Σ(n+m)·r + Σ uncompressed)·4`` bytes
per rank for float32 gradients.
"""
from __future__ import annotations

import numpy as np
import torch

from ddtrain import comm
from ddtrain.comm.compression.cast import group_size
from ddtrain.comm.compression.memory import BucketMemory, check_pieces, tensor_keys
from ddtrain.comm.compression.volume import allreduce_bytes, numel

DEFAULT_WARMUP_STEPS = 10
MIN_COMPRESSION_RATE = 2        # torch's default: compress when the factors are at most half the matrix


def parse(text: str) -> tuple[int, int]:
    """``"4"`` -> (4, 10); ``"4:2"`` -> (4, 2). ValueError naming the problem."""
    parts = text.split(":") if text else []
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"compression powersgd:{text}: write powersgd:RANK or powersgd:RANK:WARMUP_STEPS "
                         "with whole numbers, e.g. powersgd:4")
    rank = int(parts[0])
    warmup = int(parts[1]) if len(parts) == 2 else DEFAULT_WARMUP_STEPS
    if rank < 1:
        raise ValueError(f"compression powersgd:{text}: the rank must be a positive integer, got {rank}")
    if warmup < 2:
        raise ValueError(f"compression powersgd:{text}: at least 2 uncompressed warm-up steps are needed "
                         f"(DDP rebuilds its gradient buckets after the first step), got {warmup}")
    return rank, warmup


def matrix_plan(shape, rank: int) -> tuple[bool, int, int, int]:
    """(compressed?, n, m, r) for a gradient of ``shape``: torch's ``_should_compress`` on its (n, m) view."""
    if len(shape) == 0:
        return False, 1, 1, 0
    n = shape[0]
    m = numel(shape) // n if n else 0
    r = min(n, m, rank)
    return (n + m) * r * MIN_COMPRESSION_RATE < n * m, n, m, r


def payload_elements(shapes, rank: int) -> int:
    """Elements all-reduced per step after the warm-up: Σ(n+m)·r over compressed matrices + the rest."""
    total = 0
    for shape in shapes:
        compressed, n, m, r = matrix_plan(shape, rank)
        total += (n + m) * r if compressed else numel(shape)
    return total


def wire_bytes(shapes, world: int, argument=(1, DEFAULT_WARMUP_STEPS), element_size: int = 4) -> float:
    """2(R-1)/R · (Σ(n+m)·r + uncompressed elements) · element size: bytes per rank and step after the warm-up."""
    rank = argument[0] if isinstance(argument, tuple) else int(argument)
    return allreduce_bytes(payload_elements(shapes, rank) * element_size, world)


def orthogonalize_(matrices: torch.Tensor) -> None:
    """Gram-Schmidt on the columns of each matrix of a (batch, rows, r) tensor, in place (torch's, epsilon 0).

    A column that is all zeros (a layer with no gradient yet) stays zero instead of becoming NaN.
    """
    columns = matrices.shape[2]
    for i in range(columns):
        col = matrices[:, :, i:i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < columns:
            rest = matrices[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


class PowerSGD:
    """PowerSGD state of one model: per tensor the error and Q (``memory``); the step count and the seed generator.

    The error differs per rank; Q (averaged), the step count and the seed generator are the same on every rank.
    """

    def __init__(self, rank: int, warmup_steps: int = DEFAULT_WARMUP_STEPS, *, seed: int = 0,
                 error_feedback: bool = True, warm_start: bool = True):
        self.rank, self.warmup_steps = rank, warmup_steps
        self.error_feedback, self.warm_start = error_feedback, warm_start
        self.rng = np.random.RandomState(seed)     # torch's PowerSGDState draws its seeds the same way
        self.steps = 0                             # steps finished (counted at each step's last buffer)
        self.error = BucketMemory()
        self.q_memory = BucketMemory()
        self.p_memory: dict = {}                   # per bucket, overwritten before each use: scratch, not state
        self._compressing_restored = False         # restored past the warm-up: every bucket was seen before

    def all_reduce_(self, flat: torch.Tensor, shapes, *, algorithm: str = "native", group=None, key=0, keys=None,
                    last: bool = True, timeout_s: float | None = None) -> torch.Tensor:
        """Average ``flat`` (the gradients of ``shapes`` back to back) over ``group``, PowerSGD-compressed.

        ``keys`` name the tensors of ``shapes`` for the state kept between steps (``memory``).
        """
        world = group_size(group)

        def reduce(tensor):
            if tensor.numel():
                comm.all_reduce(tensor, algorithm, op="sum", group=group, timeout_s=timeout_s)
            return tensor

        if self.steps < self.warmup_steps:
            reduce(flat.div_(world))            # torch's vanilla warm-up: divide first, then sum
            self.steps += last
            return flat
        names = tensor_keys(key, len(shapes), keys)
        if self.error_feedback:
            error = self.error.get(key, tuple(zip(names, (numel(s) for s in shapes))), flat, zeros=True)
            flat.add_(error)
            before = flat.detach().clone()

        matrices, plain, q_layout = [], [], []
        offset = 0
        for name, shape in zip(names, shapes):
            size = numel(shape)
            view = flat[offset:offset + size]
            offset += size
            compressed, n, m, r = matrix_plan(tuple(shape), self.rank)
            if compressed:
                matrices.append((view.view(1, n, m), r))
                q_layout.append((name, m * r))
            else:
                plain.append(view)
        if offset != flat.numel():
            raise ValueError(f"powersgd: the shapes cover {offset} elements, the buffer has {flat.numel()}")

        p_size = sum(mat.shape[1] * r for mat, r in matrices)
        q_layout = tuple(q_layout)
        q_memory = self.q_memory.get(key, q_layout, flat) if self.warm_start else None
        if q_memory is None and not q_layout and self._compressing_restored:
            q_memory = flat.new_empty(0)        # a bucket without matrices, seen before the restart: not fresh
            self.q_memory.set(key, q_layout, q_memory)
        fresh = q_memory is None
        if fresh:
            q_memory = flat.new_empty(sum(n for _, n in q_layout))
            self.q_memory.set(key, q_layout, q_memory)
        p_memory = self.p_memory.get(key)
        if p_memory is None or p_memory.numel() != p_size or p_memory.device != flat.device:
            p_memory = self.p_memory[key] = flat.new_empty(p_size)
        ps, qs, p_at, q_at = [], [], 0, 0
        for mat, r in matrices:
            _, n, m = mat.shape
            ps.append(p_memory[p_at:p_at + n * r].view(1, n, r))
            qs.append(q_memory[q_at:q_at + m * r].view(1, m, r))
            p_at, q_at = p_at + n * r, q_at + m * r
        if not fresh:
            for q in qs:                        # warm start: last step's Q, orthogonalised again
                orthogonalize_(q)
        else:
            with torch.random.fork_rng(devices=[]):
                # the same seed on every rank, a new one at every fresh start, the global RNG untouched
                torch.manual_seed(self.rng.randint(1_000_000_000))
                for q in qs:
                    q.copy_(torch.randn(*q.shape, device="cpu", dtype=flat.dtype))
                    orthogonalize_(q)

        for (mat, _), q, p in zip(matrices, qs, ps):
            torch.bmm(mat, q, out=p)
        if plain:
            together = reduce(torch.cat(plain)).div_(world)
            at = 0
            for view in plain:
                view.copy_(together[at:at + view.numel()])
                at += view.numel()
        reduce(p_memory)                        # P is orthogonalised next, so its scale does not matter: no /R
        for p in ps:
            orthogonalize_(p)
        for (mat, _), p, q in zip(matrices, ps, qs):
            torch.bmm(mat.transpose(1, 2), p, out=q)
        reduce(q_memory).div_(world)
        for (mat, _), p, q in zip(matrices, ps, qs):
            torch.bmm(p, q.transpose(1, 2), out=mat)
        if self.error_feedback:
            error.copy_(before - flat)
        if not self.warm_start:
            self.p_memory.clear()
            self.q_memory.clear()
        self.steps += last
        return flat

    def state_dict(self) -> dict:
        """Per tensor this rank's ``error`` (what differs per rank) and Q; the step count; the seed generator's state."""
        kind, keys, pos, has_gauss, cached = self.rng.get_state()
        return {"steps": self.steps, "rng": (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                                             float(cached)),
                "error": self.error.state_dict(), "q": self.q_memory.state_dict()}

    def load_state_dict(self, state: dict, shapes: dict | None = None) -> None:
        """Take back ``state_dict()``; ``shapes`` (tensor key -> shape), when given, must fit every piece."""
        error, q = dict(state.get("error", {})), dict(state.get("q", {}))
        check_pieces(error, shapes, lambda shape: numel(shape), "error feedback")
        check_pieces(q, shapes, self._q_elements, f"Q (rank {self.rank})")
        kind, keys, pos, has_gauss, cached = state["rng"]
        self.rng.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
        self.steps = int(state["steps"])
        self.error.load_state_dict(error)
        self.q_memory.load_state_dict(q)
        self.p_memory.clear()
        self._compressing_restored = self.steps > self.warmup_steps

    def _q_elements(self, shape) -> int | None:
        compressed, _, m, r = matrix_plan(tuple(shape), self.rank)
        return m * r if compressed else None
