"""``prepare`` hands back PyTorch's own kinds of objects (issue 15): one process, one test per breakage.

Each test names the breakage it guards against; each failed on the code before the issue
(the optimizer was a plain wrapper, the model bare at world size 1, the loader a custom iterable
of ``(x, y)`` batches, DDP's options refused). The multi-rank behaviour is in test_prepare_multirank.py.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, IterableDataset, SequentialSampler,
                              TensorDataset, WeightedRandomSampler)

import ddtrain


def small(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(30, 4, generator=g), torch.randint(0, 3, (30,), generator=g))
    return model, data


def run_epoch(model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_the_optimizer_is_the_users_optimizer_class_and_schedulers_accept_it():
    # before: "TypeError: SyncedOptimizer is not an Optimizer" from StepLR after prepare
    model, data = small()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)     # made before prepare
    model, prepared, loader = ddtrain.prepare(model, optimizer, DataLoader(data, batch_size=10))
    assert isinstance(prepared, torch.optim.SGD) and isinstance(prepared, torch.optim.Optimizer)
    after = torch.optim.lr_scheduler.StepLR(prepared, step_size=1, gamma=0.1)       # made after prepare
    run_epoch(model, prepared, loader)
    before.step()
    after.step()
    assert prepared.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 * 0.1)
    assert optimizer.param_groups is prepared.param_groups                          # one state, two names
    prepared.param_groups[0]["momentum"] = 0.5                                      # param-group edits
    assert optimizer.param_groups[0]["momentum"] == 0.5
    saved = prepared.state_dict()
    assert len(saved["state"]) == 4                                                 # momentum buffers
    fresh_model, _ = small()
    fresh = torch.optim.SGD(fresh_model.parameters(), lr=1.0)
    fresh_model, fresh, _ = ddtrain.prepare(fresh_model, fresh)
    fresh.load_state_dict(saved)                                                    # checkpoint after prepare
    assert all(torch.equal(fresh.state[p]["momentum_buffer"], prepared.state[q]["momentum_buffer"])
               for p, q in zip(fresh_model.parameters(), model.parameters()))
    assert fresh.param_groups[0]["lr"] == prepared.param_groups[0]["lr"]


def test_prepared_step_equals_the_users_step_in_one_process():
    model, data = small()
    reference, _ = small()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer, loader = ddtrain.prepare(model, optimizer, DataLoader(data, batch_size=10))
    run_epoch(model, optimizer, loader)
    run_epoch(reference, ref_opt, DataLoader(data, batch_size=10, sampler=SequentialSampler(data)))
    assert all(torch.equal(a, b) for a, b in zip(model.module.parameters(), reference.parameters()))


def test_several_optimizers_step_every_parameter_group():
    # before: prepare(model, [opt1, opt2]) was accepted, then step() failed
    model, data = small()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.Adam(model[2].parameters(), lr=0.01)
    start = [p.detach().clone() for p in model.parameters()]
    model, optimizers, loader = ddtrain.prepare(model, [first, second], DataLoader(data, batch_size=10))
    assert isinstance(optimizers, list) and isinstance(optimizers[1], torch.optim.Adam)
    for x, y in loader:
        for optimizer in optimizers:
            optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for optimizer in optimizers:
            optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(start, model.parameters()))


def test_one_process_model_has_module_no_sync_and_bare_checkpoint_keys():
    # before: at world size 1 the model came back bare: no .module, no no_sync(), no unwrap helper
    bare, data = small()
    keys = list(bare.state_dict())
    model, optimizer, loader = ddtrain.prepare(bare, torch.optim.SGD(bare.parameters(), lr=0.1),
                                               DataLoader(data, batch_size=10))
    assert model.module is bare and ddtrain.unwrap(model) is bare
    assert ddtrain.unwrap(bare) is bare
    assert list(model.state_dict()) == keys                                         # no "module." prefix
    x, y = next(iter(loader))
    with model.no_sync():
        F.cross_entropy(model(x), y).backward()
    assert bare[0].weight.grad is not None
    ddp_style = {f"module.{k}": v.clone() for k, v in bare.state_dict().items()}    # saved from a plain DDP model
    model.load_state_dict(ddp_style)


def test_the_loader_is_a_dataloader_with_the_users_settings():
    # before: no .dataset/.sampler/.batch_size; the user's sampler, shuffle=False and collate_fn were replaced
    model, data = small()
    weights = torch.linspace(0.1, 1.0, len(data))
    seen = []

    def collate(items):
        seen.append(len(items))
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

    user = DataLoader(data, batch_size=7, sampler=WeightedRandomSampler(weights, 20), collate_fn=collate,
                      drop_last=True)
    model, _, loader = ddtrain.prepare(model, None, user)
    assert isinstance(loader, DataLoader) and loader.dataset is data and loader.batch_size == 7
    assert loader.sampler.sampler is user.sampler and loader.drop_last
    assert len(loader) == 2 and len(list(loader)) == 2 and seen == [7, 7]           # drop_last kept
    with torch.random.fork_rng():
        torch.manual_seed(0)                                                        # the shared seed, epoch 0
        expected = list(WeightedRandomSampler(weights, 20))
    loader.set_epoch(0)
    assert list(loader.sampler) == expected                                         # the user's sampler's order
    in_order = DataLoader(data, batch_size=30, shuffle=False)
    _, _, ordered = ddtrain.prepare(small()[0], None, in_order)
    x, _ = next(iter(ordered))
    assert torch.equal(x, data.tensors[0])                                          # shuffle=False kept


@dataclasses.dataclass
class Batch:
    image: torch.Tensor
    label: torch.Tensor
    name: str = "x"


class DictData(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"x": torch.full((4,), float(i)), "y": torch.tensor(i % 3), "w": torch.tensor(1.0),
                "meta": (torch.tensor([i]), [torch.tensor(0)])}


def test_any_batch_structure_reaches_the_loop():
    # before: only (x, y) batches; dict batches and (x, y, w) triples failed
    model, data = small()
    model, _, loader = ddtrain.prepare(model, None, DataLoader(DictData(), batch_size=3))
    batch = next(iter(loader))
    assert set(batch) == {"x", "y", "w", "meta"} and batch["x"].shape == (3, 4) and batch["meta"][0].shape == (3, 1)
    triples = TensorDataset(torch.randn(6, 4), torch.zeros(6, dtype=torch.long), torch.ones(6))
    _, _, loader = ddtrain.prepare(small()[0], None, DataLoader(triples, batch_size=3))
    x, y, w = next(iter(loader))
    assert w.shape == (3,)
    from ddtrain.training.prepared_loader import move_to_device
    moved = move_to_device(Batch(torch.ones(2), torch.zeros(2)), torch.device("cpu"))
    assert isinstance(moved, Batch) and moved.name == "x"


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(11.0).unsqueeze(1))


def test_iterable_datasets_are_accepted():
    # before: "object of type 'Stream' has no len()"
    _, _, loader = ddtrain.prepare(small()[0], None, DataLoader(Stream(), batch_size=4))
    assert torch.equal(torch.cat(list(loader)).flatten(), torch.arange(11.0))


def test_iterable_shards_split_among_loader_workers_without_duplicates():
    from ddtrain.training.prepared_loader import IterableShard
    for remainder, kept in (("drop", list(range(9))), ("pad", sorted([*range(11), 0]))):
        shares = []
        for rank in range(3):
            shard = IterableShard(Stream(), rank=rank, world_size=3, remainder=remainder)
            shares.append([int(x) for batch in DataLoader(shard, batch_size=2, num_workers=2) for x in batch.flatten()])
        # drop: the last incomplete group left out; pad: completed with the stream's first element, as
        # DistributedSampler pads with the first indices
        assert sorted(x for share in shares for x in share) == kept, remainder
        assert len({len(share) for share in shares}) == 1


def test_ddp_options_and_sync_batchnorm_are_accepted():
    # before: prepare(..., find_unused_parameters=True) raised TypeError; no SyncBatchNorm
    model, data = small()
    model, optimizer, _ = ddtrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          find_unused_parameters=True, static_graph=False, bucket_cap_mb=1,
                                          gradient_as_bucket_view=True, broadcast_buffers=False, sync_batchnorm=True)
    from ddtrain.sync.ddp import sync_batchnorm_
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Sequential(torch.nn.BatchNorm1d(2)))
    weight = net[1].weight
    sync_batchnorm_(net)
    assert isinstance(net[1], torch.nn.SyncBatchNorm) and isinstance(net[2][0], torch.nn.SyncBatchNorm)
    assert net[1].weight is weight                                                  # optimizers stay valid


def test_sync_batchnorm_hands_ddp_a_model_whose_batchnorm_layers_are_converted(monkeypatch):
    """sync_batchnorm=True on a DDP-based strategy: DDP gets the model with every BatchNorm layer (nested ones too) a
    SyncBatchNorm keeping its Parameters. One process, DDP replaced by a recorder and the CUDA-only device check
    lifted (on Gloo DDP itself refuses SyncBatchNorm on the CPU, so no forward runs here)."""
    from ddtrain.sync import ddp
    from ddtrain.sync.base import SyncOptions
    handed = []
    monkeypatch.setattr(ddp, "DDP", lambda module, **options: handed.append(module) or module)
    monkeypatch.setattr(ddp, "SYNC_BATCHNORM_DEVICES", ("cpu",))
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2),
                              torch.nn.Sequential(torch.nn.Flatten(), torch.nn.BatchNorm1d(8)))
    weights = list(net.parameters())
    ddp.ddp_model(net, SyncOptions(sync_batchnorm=True))
    assert handed == [net]
    assert [type(m).__name__ for m in net.modules() if "BatchNorm" in type(m).__name__] == ["SyncBatchNorm"] * 2
    assert list(net.parameters()) == weights
    ddp.ddp_model(plain := torch.nn.Sequential(torch.nn.BatchNorm1d(3)), SyncOptions())   # off: left as it is
    assert type(plain[0]) is torch.nn.BatchNorm1d


def test_bad_input_is_one_clear_error_naming_the_argument():
    model, data = small()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ddtrain.DDTrainError, match=r"sync_every is read only by hybrid, local-sgd, not by strategy 'ddp'"):
        ddtrain.prepare(model, sgd, strategy="ddp", sync_every=4)
    with pytest.raises(ddtrain.DDTrainError, match=r"servers is read only by ps-sync, ps-async, not by strategy 'local-sgd'"):
        ddtrain.prepare(model, sgd, strategy="local-sgd", servers=2)
    with pytest.raises(ddtrain.DDTrainError, match=r"unknown option bucket_size="):
        ddtrain.prepare(model, sgd, bucket_size=2)
    other, _ = small()
    with pytest.raises(ddtrain.DDTrainError, match=r"optimizer updates 4 tensor\(s\) that are not parameters of the model"):
        ddtrain.prepare(model, torch.optim.SGD(other.parameters(), lr=0.1))
    sharded = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    with pytest.raises(ddtrain.DDTrainError, match=r"loader.sampler is a DistributedSampler"):
        ddtrain.prepare(model, sgd, sharded)
    batches = DataLoader(data, batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ddtrain.DDTrainError, match=r"loader.batch_sampler is a custom batch sampler"):
        ddtrain.prepare(model, sgd, batches)
    with pytest.raises(ddtrain.DDTrainError,
                       match=r"sync_batchnorm is read only by ddp, ring, .*, hybrid, not by strategy 'local-sgd'"):
        ddtrain.prepare(model, sgd, strategy="local-sgd", sync_batchnorm=True)
