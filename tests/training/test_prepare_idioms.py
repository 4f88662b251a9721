"""Idioms of ordinary training scripts that a port must keep (issue 29, items 3 to 8), each against its reference.

3. evaluation sees rank 0's BatchNorm statistics, as a plain DDP model's first evaluation forward
   broadcasts them (torch's own DDP, run in the test, is the reference);
4. a schedule sized from ``len(train_loader)`` before ``prepare`` is refused with the fix;
5. local-sgd: the model a script saves after its loop (rank 0 alone) is the replicas' average,
   as a plain loop averaging every K steps and at each pass's end computes it;
6. the remainder is padded as ``DistributedSampler`` pads it (torch's sampler is the reference);
7. nanoGPT's ``model.require_backward_grad_sync = False`` skips the gradient sync;
8. a prepared model deep-copies and pickles, as a plain module, on every strategy.

Each failed on the code before issue 29 (the test says how).
"""
import copy
import functools
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from multirank import run_ranks


def bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def train_then_evaluate(strategy: str) -> dict:
    """Two steps on this rank's own batches, then an evaluation forward: its output and the running mean it used."""
    import ddtrain
    model = bn_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if strategy == "twin":
        model = DistributedDataParallel(model)
    else:
        try:
            model, optimizer, _ = ddtrain.prepare(model, optimizer, strategy=strategy)
        except SystemExit:
            return {"role": "server"}
    rank = dist.get_rank()
    for step in range(2):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        out = model(torch.linspace(-1, 1, 12).reshape(3, 4))
    running_mean = ddtrain.unwrap(model)[1].running_mean.clone()
    if strategy != "twin":
        ddtrain.shutdown()
    return {"role": "worker", "out": out, "running_mean": running_mean}


def test_evaluation_uses_rank_0s_batchnorm_statistics_as_ddp_does():
    # before: rank 1 evaluated with its own running statistics (its outputs 0.3 % away from the twin's)
    twin = run_ranks(train_then_evaluate, 2, "twin")
    ports = {strategy: run_ranks(train_then_evaluate, 2, strategy) for strategy in ("ddp", "ring", "local-sgd")}
    ports["ps-sync"] = run_ranks(train_then_evaluate, 3, "ps-sync")[:2]
    for rank in range(2):
        for strategy in ("ddp", "ring", "ps-sync"):
            assert torch.equal(ports[strategy][rank]["out"], twin[rank]["out"]), (strategy, rank)
            assert torch.equal(ports[strategy][rank]["running_mean"], twin[0]["running_mean"]), (strategy, rank)
    # local-sgd keeps each replica's statistics between averagings (they are averaged with the parameters)
    assert not torch.equal(ports["local-sgd"][1]["running_mean"], twin[0]["running_mean"])


def warmup_then_linear(step: int, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return step / num_warmup_steps
    return max(0.0, (num_training_steps - step) / (num_training_steps - num_warmup_steps))


def schedule_sized_before_prepare(kind: str) -> str:
    import ddtrain
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(40, 2)), batch_size=4, shuffle=True)    # 10 batches, 5 per rank
    epochs = 3
    scheduler = None                    # the script keeps its scheduler, to step it
    if kind == "onecycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=epochs * len(loader))
    elif kind == "get_scheduler":       # transformers' get_linear_schedule_with_warmup: a LambdaLR over a partial
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
            warmup_then_linear, num_warmup_steps=2, num_training_steps=epochs * len(loader)))
    elif kind == "per-epoch":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    try:
        model, optimizer, loader = ddtrain.prepare(model, optimizer, loader)
    except ddtrain.DDTrainError as exc:
        return str(exc)
    result = "prepared" if kind != "per-epoch" or scheduler is not None else "lost"
    if kind == "after":                 # the fix: sized from the prepared loader, it ends where the run ends
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
            warmup_then_linear, num_warmup_steps=2, num_training_steps=epochs * len(loader)))
        for _ in range(epochs):
            for (x,) in loader:
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
        result = f"prepared, final lr {optimizer.param_groups[0]['lr']:.2e}"
    ddtrain.shutdown()
    return result


@pytest.mark.parametrize("kind,field", [("onecycle", "OneCycleLR made before prepare() has total_steps=30"),
                                        ("get_scheduler", "LambdaLR made before prepare() has num_training_steps=30")])
def test_a_schedule_sized_from_the_unprepared_loader_is_refused_with_the_fix(kind, field):
    # before: accepted, and the schedule ran 2 times too long (the issue: final lr 0.0053 instead of 0.00012)
    for message in run_ranks(schedule_sized_before_prepare, 2, kind):
        assert field in message, message
        assert "10 batches of the whole data set" in message and "5 batches on each of the 2 ranks" in message
        assert "Create the scheduler after prepare()" in message


def test_schedules_by_epoch_and_schedules_made_after_prepare_are_accepted():
    assert run_ranks(schedule_sized_before_prepare, 2, "per-epoch") == ["prepared", "prepared"]
    for result in run_ranks(schedule_sized_before_prepare, 2, "after"):
        assert result == "prepared, final lr 0.00e+00", result     # the linear decay reached 0 at the last step


def local_sgd_save_after_a_loop_that_breaks(sync_every: int) -> dict:
    """A Hugging Face-style loop (``break`` at max_train_steps) under local-sgd, and a plain loop averaging by hand."""
    import ddtrain
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    plain = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(44, 4, generator=g), torch.randn(44, 2, generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader = ddtrain.prepare(model, optimizer, loader, strategy="local-sgd", sync_every=sync_every)
    world, steps, max_steps = dist.get_world_size(), 0, 2 * len(loader)
    for _ in range(2):
        for index, (x, y) in enumerate(loader):
            for net, opt in ((model, optimizer), (plain, plain_optimizer)):
                F.mse_loss(net(x), y).backward()
                opt.step()
                opt.zero_grad()
            steps += 1
            if steps % sync_every == 0 or index == len(loader) - 1:     # every K steps and at each pass's end
                with torch.no_grad():
                    for p in plain.parameters():
                        dist.all_reduce(p)
                        p /= world
            if steps >= max_steps:
                break
    saved = {k: v.clone() for k, v in model.state_dict().items()}   # what rank 0 saves here, before shutdown
    ddtrain.shutdown()
    return {"saved": saved, "plain": plain.state_dict(), "steps": steps}


def test_local_sgd_the_model_saved_after_the_loop_is_the_average():
    # before: averaged only inside ddtrain.shutdown(): rank 0 saved its own replica (0.58 % away in the issue)
    results = run_ranks(local_sgd_save_after_a_loop_that_breaks, 2, 5)
    assert results[0]["steps"] == 12                          # 6 batches a pass, 2 passes; 12 is no multiple of 5
    for key, value in results[0]["saved"].items():
        assert torch.equal(value, results[1]["saved"][key]), key          # every replica holds the average
        torch.testing.assert_close(value, results[0]["plain"][key], rtol=1e-6, atol=1e-7)


def _indices(sampler) -> list:
    return [int(i) for i in sampler]


@pytest.mark.parametrize("n,world", [(22, 3), (7, 2), (2, 3)])
def test_the_remainder_is_padded_as_distributed_sampler_pads_it(n, world):
    # before: a training loader dropped n mod R samples and an evaluation loader spread them, where
    # DistributedSampler pads (3-rank ports drifted 1.3 % from their twins)
    from ddtrain.training.prepared_loader import PreparedLoader
    data = TensorDataset(torch.arange(n))
    cpu = torch.device("cpu")
    for rank in range(world):
        train = PreparedLoader(DataLoader(data, batch_size=2, shuffle=True), rank=rank, world_size=world, device=cpu,
                               seed=5)
        evaluation = PreparedLoader(DataLoader(data, batch_size=2), rank=rank, world_size=world, device=cpu,
                                    training=False)
        reference = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)
        for epoch in range(2):
            train.set_epoch(epoch)
            reference.set_epoch(epoch)
            assert [int(i) for (batch,) in train for i in batch] == _indices(reference), (rank, epoch)
        ordered = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
        assert [int(i) for (batch,) in evaluation for i in batch] == _indices(ordered), rank
        assert len(train) == len(DataLoader(data, batch_size=2, sampler=reference))
        if n >= world:                      # the option: DistributedSampler(drop_last=True)
            dropped = PreparedLoader(DataLoader(data, batch_size=2, shuffle=True), rank=rank, world_size=world,
                                     device=cpu, seed=5, remainder="drop")
            reference = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=True)
            assert [int(i) for (batch,) in dropped for i in batch] == _indices(reference), rank


def grad_sync_switch(strategy: str) -> dict:
    """nanoGPT's idiom: the first micro-batch's backward with require_backward_grad_sync False, the second with True."""
    import ddtrain
    model = torch.nn.Linear(3, 1, bias=False)
    try:
        model, optimizer, _ = ddtrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)
    except SystemExit:
        return {"role": "server"}
    x = torch.full((1, 3), float(dist.get_rank() + 1))
    model.require_backward_grad_sync = False
    model(x).sum().backward()
    out = {"role": "worker", "local": model.module.weight.grad.clone(), "read_back": model.require_backward_grad_sync}
    try:
        optimizer.step()                          # stepping unsynchronised: the servers cannot apply it
        out["step_while_off"] = "stepped"
    except ddtrain.DDTrainError as exc:
        out["step_while_off"] = str(exc)
    model.require_backward_grad_sync = True
    model(x).sum().backward()
    out["synced"] = model.module.weight.grad.clone()
    hook = getattr(model.strategy, "hook", None)
    out["buckets"] = hook.buckets if hook is not None else None
    optimizer.step()
    ddtrain.shutdown()
    return out


def test_require_backward_grad_sync_false_skips_the_gradient_sync():
    # before: PreparedModel took the attribute as its own and ignored it: every micro-batch was all-reduced
    for strategy in ("ddp", "ring"):
        results = run_ranks(grad_sync_switch, 2, strategy)
        for rank, out in enumerate(results):
            assert out["read_back"] is False
            assert torch.equal(out["local"], torch.full((1, 3), float(rank + 1))), strategy   # this rank's own
            assert torch.equal(out["synced"], torch.full((1, 3), 3.0)), strategy     # mean of 2*(r+1) over r = 0, 1
        if strategy == "ring":
            assert [out["buckets"] for out in results] == [1, 1]                      # one reduction, not two
    for out in run_ranks(grad_sync_switch, 3, "ps-sync")[:2]:
        assert "require_backward_grad_sync = False" in out["step_while_off"], out


def copies(strategy: str, options: dict) -> dict:
    """A prepared model after two steps: deep-copied and pickled, then the copies used on rank 0 alone."""
    import ddtrain
    model = bn_model()
    try:
        prepared, optimizer, _ = ddtrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                 strategy=strategy, **options)
    except SystemExit:
        return {"role": "server"}
    for _ in range(2):
        prepared(torch.randn(4, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    out = {"role": "worker"}
    try:
        ema = copy.deepcopy(prepared)
        buffer = io.BytesIO()
        torch.save(prepared, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        state = prepared.state_dict()
        out["kinds"] = (type(ema).__name__, type(loaded).__name__)
        out["same"] = all(torch.equal(c.state_dict()[k], v) for c in (ema, loaded) for k, v in state.items())
        if dist.get_rank() == 0:          # a copy takes no part in the strategy: used on one rank alone, nothing waits
            ema(torch.ones(2, 4)).sum().backward()
            loaded.eval()
            loaded(torch.ones(2, 4))
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    ddtrain.shutdown()
    return out


@pytest.mark.parametrize("strategy,options", [("ddp", {}), ("ring", {}), ("hybrid", {"sync_every": 2}),
                                              ("local-sgd", {"outer_optimizer": "nesterov"}), ("ps-sync", {}),
                                              ("ps-async", {})])
def test_a_prepared_model_deep_copies_and_pickles_as_the_plain_module(strategy, options):
    # before: ddp's copy was a PreparedModel still wrapping DDP (used on one rank alone it waited for the other
    # until the timeout); ring: "cannot pickle '_queue.SimpleQueue' object"; local-sgd (DiLoCo): "Can't pickle
    # local object"; ps-sync, ps-async: RecursionError
    ranks = 3 if strategy.startswith("ps-") else 2
    for out in run_ranks(copies, ranks, strategy, options)[:2]:
        assert "error" not in out, out["error"]
        assert out["kinds"] == ("Sequential", "Sequential") and out["same"]
