"""ddtrain.comm.compression: the byte formulas by hand, and top-k, PowerSGD and fp16 against hand-written references on 3 ranks.

The references are written here from the papers, not from the module: top-k sparsification with
memory (Stich et al. 2018: send the k largest of gradient + error, keep the rest), and PowerSGD's
Algorithm 1 (Vogels et al. 2019: P = M Q summed, orthonormalised -- here by QR, the module uses
Gram-Schmidt -- Q = Mᵀ P averaged, M ≈ P Qᵀ, error feedback, Q reused as the next step's start).
SHAPES holds a 40x30 matrix that rank-4 PowerSGD compresses (four columns to orthogonalise: a
Gram-Schmidt that stops early is exact at rank 2 and wrong here), and fp16 is checked with
gradients of 40,000 on 3 ranks, where a sum before the division by R overflows float16.
"""
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ddtrain.comm import compression, traffic
from ddtrain.comm.compression.cast import Cast
from ddtrain.comm.compression.powersgd import PowerSGD, matrix_plan
from ddtrain.comm.compression.topk import TopK
from multirank import run_ranks

WORLD = 3
# a matrix too small to compress at rank 4, a bias (never compressed), a small conv kernel, and a
# 40x30 matrix that rank 4 compresses ((40 + 30) x 4 x 2 < 40 x 30)
SHAPES = [(12, 10), (12,), (6, 2, 3), (40, 30)]
# two matrices that rank 4 compresses in one buffer (P's and Q's offsets move past the first), a 0-d gradient
SHAPES_TWO = [(40, 30), (), (24, 20), (5,)]


def test_wire_bytes_formulas_by_hand():
    shapes, world = [(64, 32), (64,)], 4
    n = 64 * 32 + 64
    assert compression.wire_bytes("none", shapes, world) == 2 * 3 / 4 * n * 4 == 12672
    assert compression.wire_bytes("fp16", shapes, world) == compression.wire_bytes("bf16", shapes, world) == 6336
    # rank 4: the 64x32 matrix travels as P (64x4) and Q (32x4); the bias uncompressed
    assert compression.wire_bytes("powersgd:4", shapes, world) == 2 * 3 / 4 * ((64 + 32) * 4 + 64) * 4 == 2688
    # rank 16: (64+32)·16·2 = 3072 > 2048, so nothing is worth compressing: the uncompressed bytes
    assert compression.wire_bytes("powersgd:16", shapes, world) == 12672
    # top-k 10%: ceil(204.8) + ceil(6.4) = 212 values and 212 int32 indices, all-gathered to 3 peers
    assert compression.wire_bytes("topk:0.1", shapes, world) == 3 * 212 * (4 + 4) == 5088
    assert compression.COMPRESSIONS["powersgd"].error_feedback and compression.COMPRESSIONS["topk"].error_feedback
    assert not compression.COMPRESSIONS["fp16"].error_feedback


@pytest.mark.parametrize("spec, phrase", [("zip", "must be one of"), ("powersgd:0", "positive integer"),
                                          ("powersgd:4:1", "at least 2"), ("topk:0", "(0, 1]"), ("topk:1.5", "(0, 1]"),
                                          ("bf16:1", "takes no argument"), ("powersgd:x", "whole numbers"),
                                          ("topk:abc", "write topk:FRACTION"), ("powersgd", "write powersgd:RANK"),
                                          ("powersgd:4:2:1", "write powersgd:RANK")])
def test_bad_specs_name_the_problem(spec, phrase):
    with pytest.raises(ValueError, match="compression") as error:
        compression.check_spec(spec)
    assert phrase in str(error.value)


def _gradient(rank: int, step: int, shapes=SHAPES) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(sum(math.prod(s) for s in shapes), generator=g)


def compressed_steps(spec: str, steps: int = 2, shapes=SHAPES) -> tuple[list, int]:
    """Each step's averaged buffer on this rank, and the bytes it sent."""
    compressor = PowerSGD(4, 0) if spec == "powersgd" else TopK(0.25)
    out = []
    with traffic.measure() as sent:
        for step in range(steps):
            flat = _gradient(dist.get_rank(), step, shapes)
            compressor.all_reduce_(flat, shapes, algorithm="ring", key=0, last=True)
            out.append(flat)
    return out, sent.bytes_sent


def _topk_reference(steps: int = 2, world: int = WORLD) -> list:
    errors = [torch.zeros_like(_gradient(0, 0)) for _ in range(world)]
    results = []
    for step in range(steps):
        total = torch.zeros_like(errors[0])
        for rank in range(world):
            g = _gradient(rank, step) + errors[rank]
            sent = torch.zeros_like(g)
            offset = 0
            for shape in SHAPES:
                size = math.prod(shape)
                k = math.ceil(0.25 * size)
                top = g[offset:offset + size].abs().topk(k).indices + offset
                sent[top] = g[top]
                offset += size
            errors[rank] = g - sent
            total += sent
        results.append(total / world)
    return results


@pytest.mark.parametrize("world", [2, WORLD])
def test_topk_with_memory_matches_the_reference_on_three_ranks_and_sends_its_formula(world):
    """At 3 ranks, and at 2 (a path that took world 2 for world 1 would skip the exchange there)."""
    reference = _topk_reference(world=world)
    for averaged, sent in run_ranks(compressed_steps, world, "topk"):
        for got, want in zip(averaged, reference):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert sent == 2 * compression.wire_bytes("topk:0.25", SHAPES, world)


def test_topk_in_one_process_sends_the_top_entries_keeps_the_rest_and_takes_a_whole_fraction():
    """No process group (world 1): the reference of one rank; a buffer of empty tensors; fraction 1 sends all."""
    flat = _gradient(0, 0)
    got = TopK(0.25).all_reduce_(flat.clone(), SHAPES)
    torch.testing.assert_close(got, _topk_reference(steps=1, world=1)[0], rtol=0, atol=0)
    assert TopK(0.25).all_reduce_(torch.zeros(0), [(0,), (3, 0)]).numel() == 0
    assert compression.parse_spec("topk:1")[1] == 1.0
    everything = TopK(1.0)
    assert torch.equal(everything.all_reduce_(flat.clone(), SHAPES), flat)
    assert not everything.error.state_dict() or all(not v.any() for v in everything.error.state_dict().values())


def _orthonormal(a: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(a).Q


def _powersgd_reference(steps: int = 2, shapes=SHAPES) -> list:
    """Algorithm 1 of Vogels et al. over WORLD ranks, rank 4, with error feedback and warm start."""
    sizes = [math.prod(s) for s in shapes]
    errors = [torch.zeros(sum(sizes)) for _ in range(WORLD)]
    seed = np.random.RandomState(0).randint(1_000_000_000)   # the module's seeds (torch's PowerSGDState's)
    q_start = {}
    results = []
    for step in range(steps):
        inputs = [_gradient(r, step, shapes) + errors[r] for r in range(WORLD)]
        out = torch.zeros(sum(sizes))
        offset = 0
        if step == 0:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                for i, shape in enumerate(shapes):
                    if not shape:                      # a 0-d gradient: no matrix
                        continue
                    n, m = shape[0], math.prod(shape) // shape[0]
                    if (n + m) * min(n, m, 4) * 2 < n * m:
                        q_start[i] = _orthonormal(torch.randn(1, m, min(n, m, 4))[0])
        for i, (shape, size) in enumerate(zip(shapes, sizes)):
            pieces = [x[offset:offset + size] for x in inputs]
            if i not in q_start:                       # not worth compressing: the plain mean
                out[offset:offset + size] = sum(pieces) / WORLD
            else:
                n = shape[0]
                matrices = [p.view(n, -1) for p in pieces]
                p_hat = _orthonormal(sum(mat @ q_start[i] for mat in matrices))
                q = sum(mat.T @ p_hat for mat in matrices) / WORLD
                out[offset:offset + size] = (p_hat @ q.T).reshape(-1)
                q_start[i] = _orthonormal(q)           # warm start: the next step begins from this Q
            offset += size
        errors = [x - out for x in inputs]
        results.append(out)
    return results


def test_powersgd_matches_the_published_algorithm_on_three_ranks_and_sends_its_formula():
    # rank 4 must compress a matrix here, or the orthogonalisation of its 4 columns goes unchecked
    assert [s for s in SHAPES if matrix_plan(s, 4)[0]] == [(40, 30)]
    reference = _powersgd_reference()
    ranks = run_ranks(compressed_steps, WORLD, "powersgd")
    for averaged, _ in ranks:
        for got, want in zip(averaged, reference):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # per rank the ring's chunks differ by an element; over the ranks: exactly R times the mean per rank
    assert sum(sent for _, sent in ranks) == pytest.approx(WORLD * 2 * compression.wire_bytes("powersgd:4", SHAPES, WORLD),
                                                           abs=1e-6)


def test_powersgd_compresses_two_matrices_of_one_buffer_and_leaves_a_0d_gradient_alone():
    """P's and Q's offsets move past the first matrix (a slip there overlaps the second's factors); a scalar is sent
    as it is."""
    assert [s for s in SHAPES_TWO if matrix_plan(s, 4)[0]] == [(40, 30), (24, 20)]
    assert matrix_plan((), 4)[0] is False and matrix_plan((0, 7), 4)[0] is False
    reference = _powersgd_reference(shapes=SHAPES_TWO)
    for averaged, _ in run_ranks(compressed_steps, WORLD, "powersgd", 2, SHAPES_TWO):
        for got, want in zip(averaged, reference):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_powersgd_spec_reads_rank_then_warmup_and_takes_rank_1():
    assert compression.parse_spec("powersgd:4")[1] == (4, 10)          # the documented default warm-up
    assert compression.parse_spec("powersgd:4:20")[1] == (4, 20)
    assert compression.parse_spec("powersgd:1")[1] == (1, 10)
    counted = PowerSGD(4, 2)
    for _ in range(3):                                # one buffer a step: ``last`` defaults to True
        counted.all_reduce_(torch.ones(40 * 30), [(40, 30)])
    assert counted.steps == 3


def test_which_matrices_are_compressed_is_torch_s_rule_at_and_around_the_break_even():
    """torch's PowerSGD hook compresses when (n + m)·r·2 < n·m, strictly: 8x8 at rank 2 is the tie (64 = 64)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress
    for n, m, r in [(8, 8, 2), (8, 8, 1), (9, 8, 2), (12, 10, 4), (40, 30, 4), (3, 3, 1), (16, 16, 4), (17, 15, 4)]:
        assert matrix_plan((n, m), r)[0] == _should_compress(n, m, r, 2)[0], (n, m, r)
    assert matrix_plan((8, 8), 2)[0] is False


def test_a_bucket_whose_layout_grows_after_warm_up_gets_a_p_buffer_of_its_new_size():
    """The same key with a larger matrix (DDP's buckets rebuilt, a resumed job's new layout): P is reallocated, and
    the result is what a compressor that met the larger matrix under a key of its own gives."""
    small, large = (24, 20), (40, 30)
    grad = lambda shape, seed: torch.randn(math.prod(shape), generator=torch.Generator().manual_seed(seed))  # noqa: E731
    same_key, own_key = PowerSGD(4, 0), PowerSGD(4, 0)
    same_key.all_reduce_(grad(small, 1), [small], key=0)
    own_key.all_reduce_(grad(small, 1), [small], key=5)
    a, b = grad(large, 2), grad(large, 2)
    same_key.all_reduce_(a, [large], key=0)
    own_key.all_reduce_(b, [large], key=0)
    assert torch.equal(a, b)


def test_orthogonalisation_leaves_a_zero_column_zero_and_the_others_orthonormal():
    from ddtrain.comm.compression.powersgd import orthogonalize_
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 9, 4, generator=g, dtype=torch.float64)
    a[0, :, 1] = 0                                    # a layer with no gradient yet
    orthogonalize_(a)
    assert torch.isfinite(a).all() and not a[0, :, 1].any()
    for batch, cols in ((0, [0, 2, 3]), (1, [0, 1, 2, 3])):
        q = a[batch][:, cols]
        torch.testing.assert_close(q.T @ q, torch.eye(len(cols), dtype=torch.float64), rtol=0, atol=1e-12)


def _two_bucket_steps(compressor, steps, first_step=0):
    """Each step: bucket 1 holds only a bias (no matrix), then bucket 0 a 40x30 matrix; the averaged buffers."""
    out = []
    for step in range(first_step, first_step + steps):
        row = []
        for key, shape in ((1, (7,)), (0, (40, 30))):
            flat = torch.randn(math.prod(shape), generator=torch.Generator().manual_seed(10 * step + key))
            compressor.all_reduce_(flat, [shape], key=key, last=key == 0)
            row.append(flat)
        out.append(row)
    return out


@pytest.mark.parametrize("stop_after", [3, 4])
def test_powersgd_resumed_at_the_end_of_warm_up_or_after_draws_the_seeds_of_the_uninterrupted_run(stop_after):
    """Warm-up 3. Stopped after exactly 3 steps (the next is the first compressed: every bucket starts fresh, the
    matrix-free one drawing its seed first), or after 4 (every bucket seen before: none draws again). The resumed
    run's buffers and its seed generator equal the uninterrupted run's."""
    whole = PowerSGD(4, 3)
    expected = _two_bucket_steps(whole, 7)
    first = PowerSGD(4, 3)
    _two_bucket_steps(first, stop_after)
    resumed = PowerSGD(4, 3)
    resumed.load_state_dict(first.state_dict())
    got = _two_bucket_steps(resumed, 7 - stop_after, first_step=stop_after)
    for want_row, got_row in zip(expected[stop_after:], got):
        assert all(torch.equal(w, g) for w, g in zip(want_row, got_row))
    assert resumed.steps == whole.steps == 7
    assert resumed.rng.get_state()[2] == whole.rng.get_state()[2]     # the generator's position: the same draws
    # and the uninterrupted run drew exactly two seeds (both buckets fresh at step 3), as numpy's own generator says
    two = np.random.RandomState(0)
    two.randint(1_000_000_000), two.randint(1_000_000_000)
    assert whole.rng.get_state()[2] == two.get_state()[2]


def test_a_saved_q_loads_into_a_model_of_the_same_shapes_and_rank_and_is_refused_at_another_rank():
    """The Q of a compressed 40x30 gradient holds m·r = 30·4 elements; a bias keeps no Q."""
    shapes = {"w": (40, 30), "b": (40,)}
    saved = PowerSGD(4, 0)
    saved.all_reduce_(torch.randn(1240, generator=torch.Generator().manual_seed(0)), [(40, 30), (40,)],
                      keys=["w", "b"])
    state = saved.state_dict()
    assert {k: v.numel() for k, v in state["q"].items()} == {"w": 120}
    again = PowerSGD(4, 0)
    again.load_state_dict(state, shapes=shapes)
    assert torch.equal(again.state_dict()["q"]["w"], state["q"]["w"])
    with pytest.raises(ValueError, match="Q \\(rank 2\\) of tensor 'w' has 120 elements where this model and method keep 60"):
        PowerSGD(2, 0).load_state_dict(state, shapes=shapes)
    with pytest.raises(ValueError, match="Q \\(rank 4\\) of tensor 'b' has 120 elements where this model and method keep 0"):
        PowerSGD(4, 0).load_state_dict({**state, "q": {"b": state["q"]["w"]}}, shapes=shapes)   # a bias keeps no Q


def test_a_bucket_of_a_new_key_takes_the_pieces_its_tensors_left_in_other_buckets():
    """DDP rebuilt its buckets into more of them: bucket 1 is new and holds tensor b, which bucket 0 held."""
    from ddtrain.comm.compression.memory import BucketMemory
    memory = BucketMemory()
    memory.set(0, (("a", 3), ("b", 2)), torch.arange(5.0))
    got = memory.get(1, (("b", 2),), torch.zeros(2), zeros=True)
    assert torch.equal(got, torch.tensor([3.0, 4.0]))
    assert {k: v.tolist() for k, v in memory.state_dict().items()} == {"a": [0.0, 1.0, 2.0], "b": [3.0, 4.0]}


def test_the_mean_of_the_ranks_pieces_keeps_only_the_tensors_every_rank_has():
    from ddtrain.comm.compression.memory import mean_pieces
    states = [{"a": torch.tensor([0.0]), "b": torch.tensor([1.0])}, {"a": torch.tensor([3.0])},
              {"a": torch.tensor([6.0]), "b": torch.tensor([2.0])}]
    assert {k: v.tolist() for k, v in mean_pieces(states).items()} == {"a": [3.0]}


def test_powersgd_warmup_counts_steps_not_buffers():
    """Two buffers per step (two DDP buckets) and 3 warm-up steps: steps 0-2 are exact (one process: the mean is the
    buffer itself), step 3 is the first compressed one. Counting buffers would compress from step 1 (the 3rd buffer)."""
    compressor = PowerSGD(4, 3)
    changed = []
    for step in range(5):
        row = []
        for key in (0, 1):
            gradient = torch.randn(40 * 30, generator=torch.Generator().manual_seed(10 * step + key))
            flat = gradient.clone()
            compressor.all_reduce_(flat, [(40, 30)], key=key, last=key == 1)
            row.append(not torch.equal(flat, gradient))
        changed.append(row)
    assert changed == [[False, False]] * 3 + [[True, True]] * 2


CAST_VALUES = 40_000.0    # x 3 ranks = 120,000: beyond float16's largest finite value, 65,504


def cast_mean(name: str, algorithm: str) -> torch.Tensor:
    rank = dist.get_rank()
    flat = CAST_VALUES + 1000.0 * rank + torch.arange(8, dtype=torch.float32)   # 40,000-42,007 on every rank
    return Cast(name).all_reduce_(flat, algorithm=algorithm)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_16_bit_casts_divide_by_r_before_the_sum_so_large_gradients_stay_finite_on_three_ranks(name):
    """torch's fp16/bf16 hooks divide by R before the 16-bit sum; summing first is exact on 2 ranks for small values
    but overflows float16 here (3 x 40,000). The mean must be finite and within the 16-bit type's rounding."""
    want = CAST_VALUES + 1000.0 + torch.arange(8, dtype=torch.float64)            # the float64 mean over ranks 0-2
    tolerance = {"fp16": 2e-3, "bf16": 2e-2}[name]                                 # a few units in the last place
    for algorithm in ("ring", "native"):
        for got in run_ranks(cast_mean, WORLD, name, algorithm):
            assert torch.isfinite(got).all(), (name, algorithm, got)
            torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=0)
