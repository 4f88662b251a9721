"""Every all-reduce algorithm and op against torch.distributed.all_reduce, on Gloo, world sizes 1-8.

One pool of 8 ranks serves every world size: world size k < 8 runs on a process group of k
ranks chosen so that group ranks differ from global ranks (which also tests the translation
between the two); k = 8 runs on the default group. Hypothesis draws batches of cases (dtype,
length, op, layout, seed) in this process; each batch is checked in one round-trip to the ranks.
The ranks never assert (a rank that stopped early would leave the others waiting): they return
their findings, and the assertions are made here.
"""
from __future__ import annotations

import hashlib
import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multirank import run_ranks

import ddtrain.comm as comm
from ddtrain.comm import ring_async
from ddtrain.errors import DDTrainError

POOL = 8
TIMEOUT_S = 600   # the first call starts 8 processes: minutes on a busy 2-core machine
ALGORITHMS = list(comm.ALGORITHMS)
DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
          "complex64"]
EXACT = {"int64", "int32", "int16", "int8", "uint8", "bool"}
EPS = {"float32": 2.0 ** -23, "float64": 2.0 ** -52, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7,
       "complex64": 2.0 ** -23}
TORCH_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
            "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

_groups: dict = {}


def group_ranks(world: int) -> list[int]:
    """k distinct global ranks, not 0..k-1 for k < 8 (3 is coprime with 8)."""
    return sorted((3 * i + 1) % POOL for i in range(world))


def subgroup(world: int, key=None):
    """(group, is_member) for a world of ``world`` ranks; every rank of the pool must call it."""
    key = key or world
    if key not in _groups:
        _groups[key] = None if world == POOL and key == world else dist.new_group(group_ranks(world))
    group = _groups[key]
    return group, (group is None or dist.get_rank(group) >= 0)


def make_input(dtype_name: str, length: int, op: str, layout: str, seed: int, rank: int) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.bool:
        x = torch.rand(length, generator=g) < 0.5
    elif dtype_name in EXACT:
        hi = 4 if op == "prod" else 100
        lo = 0 if dtype == torch.uint8 else -hi
        x = torch.randint(lo, hi, (length,), generator=g).to(dtype)
    elif op == "prod":                      # near 1, so 8-fold products stay finite in float16
        x = (0.5 + torch.rand(length, generator=g, dtype=torch.float64)).to(dtype)
    elif dtype.is_complex:
        x = torch.randn(length, generator=g, dtype=torch.complex128).to(dtype)
    else:
        x = (torch.randn(length, generator=g, dtype=torch.float64) * 10).to(dtype)
    if layout == "2d" and length % 2 == 0:
        return x.view(2, -1)
    if layout == "strided":                 # a non-contiguous view of a bigger tensor
        return torch.stack([x, torch.zeros_like(x)], dim=1)[:, 0]
    return x


def torch_reference(x: torch.Tensor, op: str, group, world: int) -> torch.Tensor:
    ref = x.clone().contiguous()
    buf = ref.to(torch.int32) if ref.dtype == torch.int16 else ref   # Gloo has no int16 reduction
    dist.all_reduce(buf, op=TORCH_OP[op], group=group)
    if op == "avg":
        buf /= world
    return buf.to(ref.dtype)


def _findings(world: int, cases: list) -> dict | None:
    """On every rank of the pool: run the cases on a world of ``world`` ranks; report, never assert."""
    group, member = subgroup(world)
    if not member:
        return None
    return check_cases(group, world, cases)


def check_cases(group, world: int, cases: list, device: str = "cpu") -> dict:
    """Every algorithm on every case against torch on ``group``: {"problems": [...], "digests": [...]}."""
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    problems, digests = [], []
    for index, (dtype_name, length, op, layout, seed) in enumerate(cases):
        x = make_input(dtype_name, length, op, layout, seed, me).to(device)
        try:
            comm.ops.check_op(op, x.dtype)
        except DDTrainError:
            for algorithm in ALGORITHMS:    # refused at the boundary, before any communication
                try:
                    comm.all_reduce(x.clone(), algorithm, op, group)
                    problems.append(f"case {index}: {algorithm} accepted {op} on {dtype_name}")
                except DDTrainError:
                    pass
            digests.append("refused")
            continue
        ref = torch_reference(x, op, group, world)
        exact64 = None
        if dtype_name not in EXACT and op in ("sum", "avg", "prod"):
            # The float64 result and the scale of its rounding error (sum or product of |x|), in one call.
            wide = x.to(torch.complex128 if x.is_complex() else torch.float64).reshape(-1)
            both = torch.cat([torch.view_as_real(wide).reshape(-1) if wide.is_complex() else wide,
                              x.abs().to(torch.float64).reshape(-1)])
            dist.all_reduce(both, op=TORCH_OP[op], group=group)
            if op == "avg":
                both /= world
            split = both.numel() - x.numel()
            exact = both[:split].view(-1, 2) if x.is_complex() else both[:split]
            exact = (torch.view_as_complex(exact) if x.is_complex() else exact).view(x.shape)
            exact64 = (exact, both[split:].view(x.shape))
        ring_async.SEGMENT_BYTES = 64 if seed % 2 else 256 * 1024   # many segments, or the default
        case_digests = {}
        for algorithm in ALGORITHMS:
            t = x.clone()
            out = comm.all_reduce(t, algorithm, op, group)
            if out is not t:
                problems.append(f"case {index}: {algorithm} did not return its input tensor")
            if out.shape != x.shape or out.dtype != x.dtype:
                problems.append(f"case {index}: {algorithm} changed shape/dtype")
            bad = _compare(out, ref, exact64, dtype_name, op, world)
            if bad:
                problems.append(f"case {index} {(dtype_name, length, op, layout, seed)} {algorithm}: {bad}")
            case_digests[algorithm] = digest(out)
        if case_digests["ring"] != case_digests["ring-async"]:
            problems.append(f"case {index}: ring and ring-async differ (same reduction order expected)")
        digests.append(case_digests)
    return {"problems": problems, "digests": digests}


def digest(t: torch.Tensor) -> str:
    """A hash of the tensor's bits (copied out first: a strided view's bytes are not its values)."""
    packed = torch.empty(t.numel(), dtype=t.dtype)   # on the CPU, whatever the tensor's device
    packed.copy_(t.reshape(-1))
    return hashlib.sha1(packed.view(torch.uint8).numpy().tobytes()).hexdigest()


def _compare(out, ref, exact64, dtype_name, op, world) -> str:
    if exact64 is None:                     # integers, bool, max, min: exactly torch's answer
        same = torch.equal(out, ref) or (out.is_floating_point() and torch.equal(out.isnan(), ref.isnan())
                                         and torch.equal(out[~out.isnan()], ref[~ref.isnan()]))
        return "" if same else f"differs from torch: {out.reshape(-1)[:6].tolist()} vs {ref.reshape(-1)[:6].tolist()}"
    exact, scale = exact64
    # Each of the world-1 roundings of a partial result costs at most eps * sum|x| (for a
    # product, eps * |product|); the final division for avg one more eps.
    bound = 2 * world * EPS[dtype_name] * scale + 1e-300
    for name, value in (("ours", out), ("torch's", ref)):
        wide = value.to(exact.dtype).contiguous()
        err = (wide - exact).abs()
        if not bool((err <= bound).all()):
            worst = int(torch.argmax((err - bound).reshape(-1).real if err.is_complex() else (err - bound).reshape(-1)))
            return (f"{name} result off by {err.reshape(-1)[worst].item():.3g} > bound "
                    f"{bound.reshape(-1)[worst].item():.3g} at {worst}")
    return ""


def case_strategy():
    lengths = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7, 8, 13, 64, 97, 1000]), st.integers(0, 400))
    return st.tuples(st.sampled_from(DTYPES), lengths, st.sampled_from(list(comm.OPS)),
                     st.sampled_from(["flat", "flat", "2d", "strided"]), st.integers(0, 2 ** 20))


def coverage_cases(world: int) -> list:
    """Every op on three dtypes, rotating with the world size so that the eight world sizes
    together give every dtype every op about twice, at seeded-random lengths. (Hypothesis
    tries its simplest example -- all lengths 0 -- first, so it alone would cover little.)"""
    rng = random.Random(world)
    cases = []
    for i in range(3):
        dtype_name = DTYPES[(3 * world + i) % len(DTYPES)]
        for op in comm.OPS:
            cases.append((dtype_name, rng.choice([1, 2, 3, 7, 13, 31, 100, 257, 1000]), op,
                          rng.choice(["flat", "2d", "strided"]), rng.randrange(2 ** 20)))
    return cases


@pytest.mark.parametrize("world", range(1, POOL + 1))
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(drawn=st.lists(case_strategy(), min_size=4, max_size=8))
def test_every_algorithm_matches_torch_and_is_bitwise_identical_across_ranks(world, drawn):
    cases = coverage_cases(world) + drawn
    results = [r for r in run_ranks(_findings, POOL, world, cases, timeout_s=TIMEOUT_S) if r is not None]
    assert len(results) == world
    problems = sorted({p for r in results for p in r["problems"]})
    assert not problems, "\n".join(problems[:20])
    for index in range(len(cases)):
        per_rank = [r["digests"][index] for r in results]
        assert all(d == per_rank[0] for d in per_rank), f"case {cases[index]}: ranks disagree bitwise"


def _findings_on_the_gpu_code_path(world: int, cases: list) -> dict | None:
    from ddtrain.comm import p2p
    p2p.GPU_PATH_ON_CPU = True
    try:
        return _findings(world, cases)
    finally:
        p2p.GPU_PATH_ON_CPU = False


@pytest.mark.parametrize("world", [2, 3, 5])
def test_the_cuda_code_path_runs_on_gloo_too(world):
    """CI has no GPU: run the batched, stream-ordered path that CUDA tensors take, on CPU tensors."""
    cases = coverage_cases(world + 3)
    results = [r for r in run_ranks(_findings_on_the_gpu_code_path, POOL, world, cases, timeout_s=TIMEOUT_S)
               if r is not None]
    problems = sorted({p for r in results for p in r["problems"]})
    assert not problems, "\n".join(problems[:20])
    for index in range(len(cases)):
        assert len({r["digests"][index] if isinstance(r["digests"][index], str) else
                    tuple(sorted(r["digests"][index].items())) for r in results}) == 1


# central's documented order: rank 0 folds x_0 + x_1 + x_2 + x_3 in rank order. In column k, x_0 = 1e8 and
# x_k = -1e8 and the others 1: a 1 added before the -1e8 is lost (1e8 + 1 rounds to 1e8 in float32), one after
# it is kept, so the column's sum is where rank k came; the three columns tell every order of x_1..x_3 apart
# (checked in the test), so any other order, or the order the buffers arrive in, changes the result.
CENTRAL_COLUMNS = torch.tensor([[1e8, 1e8, 1e8],
                                [-1e8, 1.0, 1.0],
                                [1.0, -1e8, 1.0],
                                [1.0, 1.0, -1e8]], dtype=torch.float32)


def _fold(rows) -> torch.Tensor:
    total = rows[0].clone()
    for row in rows[1:]:
        total += row
    return total


def _central_sum():
    group, member = subgroup(4)
    if not member:
        return None
    flat = CENTRAL_COLUMNS[dist.get_rank(group)].clone()
    return comm.all_reduce(flat, "central", op="sum", group=group)


def test_central_reduces_in_rank_order_as_documented():
    import itertools
    want = _fold(CENTRAL_COLUMNS)
    for order in itertools.permutations((1, 2, 3)):     # the columns tell every order of the others apart
        assert order == (1, 2, 3) or not torch.equal(_fold(CENTRAL_COLUMNS[[0, *order]]), want), order
    results = [r for r in run_ranks(_central_sum, POOL, timeout_s=TIMEOUT_S) if r is not None]
    assert len(results) == 4
    for got in results:
        assert torch.equal(got, want), (got, want)


def test_world_of_one_without_process_group_returns_at_once():
    assert not dist.is_initialized()
    for algorithm in ALGORITHMS:
        for op in comm.OPS:
            t = torch.arange(7, dtype=torch.float32)
            assert comm.all_reduce(t, algorithm, op) is t
            assert torch.equal(t, torch.arange(7, dtype=torch.float32))


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(DDTrainError, match="valid: butterfly, central, native, ring, ring-async, tree"):
        comm.all_reduce(torch.ones(3), "hypercube")
    with pytest.raises(DDTrainError, match="valid: avg, max, min, prod, sum"):
        comm.all_reduce(torch.ones(3), "ring", "mean")
    with pytest.raises(DDTrainError, match="needs a floating-point dtype"):
        comm.all_reduce(torch.ones(3, dtype=torch.int32), "ring", "avg")
    with pytest.raises(DDTrainError, match="not supported"):
        comm.all_reduce(torch.ones(3, dtype=torch.uint16), "tree")


def _missed_deadline(algorithm: str):
    """Group rank 1 never joins; group rank 0 must give up after its deadline and say on whom it waited."""
    group, member = subgroup(2, key=("deadline", algorithm))
    if not member:
        return None
    if dist.get_rank(group) == 1:
        return "absent"
    try:
        comm.all_reduce(torch.ones(4), algorithm, "sum", group, timeout_s=0.5)
    except comm.CommError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_a_missed_deadline_names_the_operation_and_the_peer(algorithm):
    results = [r for r in run_ranks(_missed_deadline, POOL, algorithm, timeout_s=TIMEOUT_S) if r is not None]
    message = next(r for r in results if r != "absent")
    peer = group_ranks(2)[1]
    assert message.startswith(f"{algorithm}: ") and "timed out after 0.5s" in message, message
    assert f"group rank 1 (global rank {peer})" in message, message


# --- CUDA tensors: NCCL (one process per GPU), and Gloo staging them through the CPU ------------

def _cuda_rank(rank: int, world: int, port: int, cases: list, results) -> None:
    import datetime
    import os
    import traceback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                                timeout=datetime.timedelta(seconds=60))
        out = {"nccl": check_cases(None, world, cases, str(device))}
        gloo = dist.new_group(backend="gloo")
        out["gloo"] = check_cases(gloo, world, cases[::3], str(device))
        torch.cuda.synchronize()
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_on_nccl_and_staged_through_gloo():
    """One process per GPU (all GPUs, at most 8): every algorithm, op and dtype on CUDA tensors."""
    import multiprocessing as mp

    from multirank import free_port

    world = min(torch.cuda.device_count(), POOL)
    cases = []
    for world_seed in range(1, 4):
        cases += coverage_cases(world_seed)
    cases += [("float32", 3 * 1024 * 1024 + 5, "sum", "flat", 1), ("bfloat16", 777_777, "avg", "flat", 2)]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_cuda_rank, args=(r, world, port, cases, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        answers = dict(results.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():       # a rank left waiting for one that failed
                p.kill()
    failed = {r: a for r, a in answers.items() if isinstance(a, str)}
    assert not failed, failed
    for backend, used in (("nccl", cases), ("gloo", cases[::3])):
        per_rank = [answers[r][backend] for r in range(world)]
        problems = sorted({p for r in per_rank for p in r["problems"]})
        assert not problems, f"{backend}:\n" + "\n".join(problems[:20])
        for index, case in enumerate(used):
            digests = [r["digests"][index] for r in per_rank]
            assert all(d == digests[0] for d in digests), f"{backend} {case}: ranks disagree bitwise"
