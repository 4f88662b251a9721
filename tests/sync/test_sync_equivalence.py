"""Every synchronous strategy on R ranks x batch B takes the steps of a plain PyTorch loop with batch R*B.

The reference is written here, with nothing of ddtrain in it but the shared data and initial
model: ``torch.optim.SGD`` over the batches of one seeded permutation per epoch (the balanced
sharding's promise: the union of the ranks' step-s batches is the step-s batch of one process
with an R-times larger batch). A bug that ddtrain's single-process path shares with its
distributed one (every gradient halved, say) is therefore caught, which comparing ddtrain
with itself could not. One pool call per world size runs every strategy in turn (tiny MLP, 96
samples, 2 epochs: 12, 8 or 6 steps), compared to 1e-5 relative. ps-sync runs on R workers + 1
server (so on R+1 ranks); hybrid with a broadcast every step (K=1) and every 4 steps (its
gradients are averaged every step, so K does not change the steps); local-sgd with K=1 (plain
SGD, and momentum, which stays equivalent at K=1 because momentum is linear in the gradients)
and with K=3, whose reference is R plain loops on the ranks' shards averaged every 3 steps.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from ddtrain import TrainConfig, fit
from ddtrain.sync import STRATEGIES
from multirank import run_ranks
from helpers import N_SAMPLES, assert_same_parameters, plain_sgd, tiny_data as _data, tiny_model as _model

BATCH, EPOCHS, LR, SEED = 8, 2, 0.1, 3
# every synchronous strategy whose every rank trains (DDP and its hooks, hybrid); the parameter-server ones
SYNCHRONOUS = [name for name, spec in STRATEGIES.items() if spec.synchronous and not spec.uses_servers]
WITH_SERVERS = [name for name, spec in STRATEGIES.items() if spec.synchronous and spec.uses_servers]
CASES = {                  # world size -> [(strategy, workers, momentum, sync_every)]
    2: [(s, 2, 0.9, 1) for s in SYNCHRONOUS] + [("hybrid", 2, 0.9, 4), ("local-sgd", 2, 0.0, 1),
                                                ("local-sgd", 2, 0.9, 1), ("local-sgd", 2, 0.0, 3)],
    3: [(s, 3, 0.9, 1) for s in SYNCHRONOUS] + [("local-sgd", 3, 0.0, 1), ("local-sgd", 3, 0.0, 3)]
    + [(s, 2, 0.9, 1) for s in WITH_SERVERS],
    4: [(s, 3, 0.9, 1) for s in WITH_SERVERS] + [(s, 2, 0.9, 1) for s in WITH_SERVERS],   # the second: 2 servers
}


def epoch_order(epoch: int) -> torch.Tensor:
    """The permutation every rank shares in ``epoch`` (epochs count from 1), seeded by the run's seed."""
    return torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))


def plain_loop(global_batch: int, momentum: float) -> dict:
    """One process, batch ``global_batch``: the steps every synchronous strategy must take."""
    model, shape = _model("mlp")
    train = _data(shape).train
    return plain_sgd(model, train.x, train.y, lr=LR, momentum=momentum, epochs=EPOCHS, global_batch=global_batch,
                     epoch_order=epoch_order)


def plain_local_sgd(workers: int, every: int) -> dict:
    """``workers`` plain loops, each on its rank's shard (every R-th index), parameters averaged every ``every`` steps."""
    model, shape = _model("mlp")
    train = _data(shape).train
    replicas = [copy.deepcopy(model) for _ in range(workers)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in replicas]
    per_rank = N_SAMPLES // workers
    steps = taken = 0
    for epoch in range(1, EPOCHS + 1):
        order = epoch_order(epoch)
        for s in range(per_rank // BATCH):
            for r, (m, opt) in enumerate(zip(replicas, optimizers)):
                idx = order[r:per_rank * workers:workers][s * BATCH:(s + 1) * BATCH]
                opt.zero_grad()
                F.cross_entropy(m(train.x[idx]), train.y[idx]).backward()
                opt.step()
            steps += 1
            if steps % every == 0:
                average(replicas)
                taken = steps
    if steps > taken:                  # the run ends with an averaging
        average(replicas)
    return replicas[0].state_dict()


def average(replicas) -> None:
    with torch.no_grad():
        for params in zip(*(m.parameters() for m in replicas)):
            mean = torch.stack(list(params)).mean(0)
            for p in params:
                p.copy_(mean)


def train(strategy: str, momentum: float, sync_every: int = 1, servers: int = 1):
    """Parameters after training, steps of the last epoch, this rank's role and divergence record."""
    model, shape = _model("mlp")
    config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy=strategy, epochs=EPOCHS,
                                   batch_size=BATCH, lr=LR, momentum=momentum, seed=SEED, val_fraction=0.0,
                                   quiet=True, check_every=3, servers=servers, sync_every=sync_every)
    record = fit(model, _data(shape), config)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mine = next(c for c in record["comm"] if c["rank"] == torch.distributed.get_rank())
    return params, record["epochs"][-1]["steps"] if record["epochs"] else 0, record["role"], \
        mine.get("divergence_max", 0.0)


def train_cases(cases, world):
    return [train(strategy, momentum, every, servers=world - workers if STRATEGIES[strategy].uses_servers else 1)
            for strategy, workers, momentum, every in cases]


def reference(strategy, workers, momentum, every):
    if strategy == "local-sgd" and every > 1:
        assert momentum == 0.0
        return plain_local_sgd(workers, every)
    return plain_loop(BATCH * workers, momentum)


def test_the_plain_loop_is_sensitive_to_a_halved_gradient():
    """The reference itself: the same loop with every gradient halved ends elsewhere (what the tests can see)."""
    halved, _ = _model("mlp")
    full = plain_loop(16, 0.9)
    model, shape = _model("mlp")
    train_set = _data(shape).train
    optimizer = torch.optim.SGD(model.parameters(), lr=LR / 2, momentum=0.9)  # lr/2 == every gradient halved
    for epoch in range(1, EPOCHS + 1):
        order = epoch_order(epoch)
        for s in range(N_SAMPLES // 16):
            idx = order[s * 16:(s + 1) * 16]
            optimizer.zero_grad()
            F.cross_entropy(model(train_set.x[idx]), train_set.y[idx]).backward()
            optimizer.step()
    with pytest.raises(AssertionError):
        assert_same_parameters(full, model.state_dict())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_synchronous_strategy_takes_the_steps_of_a_plain_loop_with_the_global_batch(world):
    cases = CASES[world]
    per_rank = run_ranks(train_cases, world, cases, world, timeout_s=300)
    for i, (strategy, workers, momentum, every) in enumerate(cases):
        expected = reference(strategy, workers, momentum, every)
        trained = [per_rank[r][i] for r in range(world)]
        assert [role for _, _, role, _ in trained] == ["worker"] * workers + ["server"] * (world - workers)
        for rank, (params, steps, _role, divergence) in enumerate(trained[:workers]):
            assert steps == N_SAMPLES // (BATCH * workers), (strategy, rank)
            try:
                assert_same_parameters(expected, params)
            except AssertionError as exc:
                raise AssertionError(f"{strategy} (K={every}) on {world} ranks, rank {rank}: {exc}") from None
            if every == 1:
                assert divergence == 0.0, (strategy, rank, divergence)   # bitwise-identical replicas
