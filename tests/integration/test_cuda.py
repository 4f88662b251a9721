"""The GPU path: NCCL, our algorithms on CUDA tensors, mixed precision, channels-last, GPU-resident data.

Skipped without CUDA (CI has none); run on a GPU machine with ``python -m pytest -q tests/test_cuda.py``.
"""

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")]

ALGORITHMS = ["native", "ring", "ring-async", "tree", "butterfly", "central"]


def _nccl_worker(rank, world, port, results):
    import datetime

    import torch.distributed as dist

    from ddtrain import comm
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    failures = []
    for algorithm in ALGORITHMS:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for n in (0, 1, 7, 1000, 1 << 20):
                for op in ("sum", "max", "avg") if dtype.is_floating_point else ("sum", "max"):
                    g = torch.Generator(device="cuda").manual_seed(1000 * rank + n)
                    base = (torch.randn(n, device="cuda", generator=g) * 10).to(dtype)
                    ours, ref = base.clone(), base.clone()
                    comm.all_reduce(ours, algorithm=algorithm, op=op)
                    dist.all_reduce(ref, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                             "avg": dist.ReduceOp.AVG}[op])
                    if not torch.allclose(ours.double(), ref.double(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                          atol=1e-3):
                        failures.append((algorithm, str(dtype), n, op))
                    gathered = [torch.empty_like(ours) for _ in range(world)]
                    dist.all_gather(gathered, ours)
                    if any(not torch.equal(gathered[0], t) for t in gathered):
                        failures.append((algorithm, str(dtype), n, op, "not bitwise equal across ranks"))
    results[rank] = failures
    dist.destroy_process_group()


def test_our_algorithms_on_cuda_tensors_through_nccl():
    import torch.multiprocessing as mp

    from ddtrain.distributed.launch import free_port
    world = min(2, torch.cuda.device_count())
    results = mp.Manager().dict()
    mp.spawn(_nccl_worker, args=(world, free_port(), results), nprocs=world, join=True)
    assert all(results[r] == [] for r in range(world)), dict(results)


def test_world_of_one_returns_at_once_on_cuda():
    from ddtrain import comm
    t = torch.arange(10.0, device="cuda")
    for algorithm in ALGORITHMS[1:]:
        assert torch.equal(comm.all_reduce(t.clone(), algorithm=algorithm), t)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_fit_on_cuda_with_amp_channels_last_and_gpu_resident_data(amp):
    from ddtrain import TrainConfig, fit
    from ddtrain.data import Data
    from ddtrain.data.arrays import ArrayDataset
    from ddtrain.models import build_model
    x, y = torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))
    data = Data("t", ArrayDataset(x, y, num_classes=10), None, 10, (3, 32, 32), "classification")
    model = build_model("resnet18", num_classes=10, in_channels=3, input_size=(32, 32))
    record = fit(model, data, TrainConfig.from_flat(model="resnet18", data="t", epochs=2, batch_size=64, lr=0.05,
                                          val_fraction=0.0, amp=amp, channels_last=True, quiet=True))
    assert record["versions"]["device"].startswith("cuda")
    assert record["epochs"][-1]["train_loss"] < record["epochs"][0]["train_loss"] * 1.5
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_host_batches_copied_ahead_on_a_side_stream_match_the_cpu_batches():
    from ddtrain.data.arrays import ArrayDataset
    from ddtrain.data.loading import ShardLoader, to_device
    from ddtrain.data.sharding import ShardSampler
    from ddtrain.data.synthetic import load_synthetic
    ds = ArrayDataset(torch.randn(300, 3, 8, 8), torch.arange(300), num_classes=300)
    cpu = ShardLoader(ds, ShardSampler(300, rank=0, world_size=1, seed=5), 32, torch.device("cpu"))
    gpu = ShardLoader(ds, ShardSampler(300, rank=0, world_size=1, seed=5), 32, torch.device("cuda"),
                      channels_last=True)
    pairs = list(zip(cpu, gpu))
    assert len(pairs) == cpu.steps == 10
    for (xc, yc), (xg, yg) in pairs:
        assert xg.is_cuda and xg.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(xc, xg.cpu()) and torch.equal(yc, yg.cpu())
    lazy = load_synthetic("cifar10", samples=500, lazy=True)
    on_gpu = to_device(lazy, torch.device("cuda"), channels_last=True)
    assert isinstance(on_gpu, ArrayDataset) and on_gpu.x.is_cuda
    idx = torch.tensor([3, 499, 0])
    assert torch.equal(on_gpu.batch(idx.cuda())[0], lazy.to("cuda").batch(idx.cuda())[0])
    # computed on the GPU: the same samples as on the CPU up to float rounding of the upsampling
    assert torch.allclose(on_gpu.batch(idx.cuda())[0].cpu(), lazy.batch(idx)[0], atol=1e-5)


def _profiled_fit(dataset, data_on_device, steps=30):
    from ddtrain import TrainConfig, fit
    from ddtrain.data import Data
    from ddtrain.models import build_model
    from ddtrain.observe import profiler
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=10, in_channels=3, input_size=(64, 64))
    config = TrainConfig.from_flat(model="resnet18", data="synthetic", strategy="ddp", epochs=0, steps=steps,
                                   batch_size=64, lr=0.01, val_fraction=0.0, amp="bf16", data_on_device=data_on_device,
                                   quiet=True, profile=True, warmup_steps=5)
    record = fit(model, Data("synthetic", dataset, None, 10, (3, 64, 64), "classification"), config,
                 callbacks=profiler.callbacks(config.profile))
    rank = record["profile"]["ranks"][0]
    assert rank["split_clock"] == "cuda events on the training stream"
    split = rank["split_s"]
    return split["data_s"] / sum(split.values()), rank


def test_gpu_split_shows_no_data_wait_for_gpu_resident_data():
    """The truth is known: the batches are on the GPU, so the GPU never waits for data."""
    from ddtrain.data.arrays import ArrayDataset
    x = torch.randn(64 * 31, 3, 64, 64, device="cuda")
    y = torch.randint(0, 10, (64 * 31,), device="cuda")
    share, rank = _profiled_fit(ArrayDataset(x, y, num_classes=10), "yes")
    assert share < 0.02, rank


def test_gpu_split_shows_the_data_wait_of_a_deliberately_slow_loader():
    import time

    from torch.utils.data import Dataset

    from ddtrain.data.arrays import ArrayDataset

    class Slow(Dataset):
        def __init__(self, inner):
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            time.sleep(0.002)  # 128 ms of host time per batch of 64, against a few ms of GPU work
            return self.inner[i]

    inner = ArrayDataset(torch.randn(64 * 21, 3, 64, 64), torch.randint(0, 10, (64 * 21,)), num_classes=10)
    share, rank = _profiled_fit(Slow(inner), "no", steps=20)
    assert share > 0.5, rank
