"""Every synchronous strategy on R ranks x batch B takes the steps of one process with batch R*B (acceptance 1).

One pool call per world size runs every strategy in turn (tiny MLP, 96 samples, 2 epochs:
12, 8 or 6 steps), and each result is compared with a single-process run with the global
batch, to 1e-5 relative. ps-sync runs on R workers + 1 server (so on R+1 ranks); hybrid with
a broadcast every step (K=1); local-sgd averaging every step (K=1) with plain SGD, and also
with momentum, which stays equivalent at K=1 because momentum is linear in the gradients.
"""
import pytest
import torch

from ddtrain import TrainConfig, fit
from ddtrain.sync import STRATEGIES
from multirank import run_ranks
from helpers import N_SAMPLES, assert_same_parameters, tiny_data as _data, tiny_model as _model

BATCH = 8
# every synchronous strategy whose every rank trains (DDP and its hooks, hybrid); the parameter-server ones
SYNCHRONOUS = [name for name, spec in STRATEGIES.items() if spec.synchronous and not spec.uses_servers]
WITH_SERVERS = [name for name, spec in STRATEGIES.items() if spec.synchronous and spec.uses_servers]
CASES = {                                   # world size -> [(strategy, workers, momentum)]
    2: [(s, 2, 0.9) for s in SYNCHRONOUS] + [("local-sgd", 2, 0.0), ("local-sgd", 2, 0.9)],
    3: [(s, 3, 0.9) for s in SYNCHRONOUS] + [("local-sgd", 3, 0.0)] + [(s, 2, 0.9) for s in WITH_SERVERS],
    4: [(s, 3, 0.9) for s in WITH_SERVERS] + [(s, 2, 0.9) for s in WITH_SERVERS],   # the second: 2 servers, sharded
}


def train(strategy: str, batch_size: int, momentum: float, epochs: int = 2, servers: int = 1):
    """Parameters after training, steps of the last epoch, and this rank's role."""
    model, shape = _model("mlp")
    config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy=strategy, epochs=epochs, batch_size=batch_size,
                         lr=0.1, momentum=momentum, seed=3, val_fraction=0.0, quiet=True, check_every=3,
                         servers=servers)
    record = fit(model, _data(shape), config)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mine = next(c for c in record["comm"] if c["rank"] == (torch.distributed.get_rank()
                                                          if torch.distributed.is_initialized() else 0))
    return params, record["epochs"][-1]["steps"] if record["epochs"] else 0, record["role"], \
        mine.get("divergence_max", 0.0)


def train_cases(cases, world):
    return [train(strategy, BATCH, momentum, servers=world - workers if STRATEGIES[strategy].uses_servers else 1)
            for strategy, workers, momentum in cases]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_synchronous_strategy_equals_one_process_with_the_global_batch(world):
    cases = CASES[world]
    references = {}
    for _, workers, momentum in cases:
        if (workers, momentum) not in references:
            references[workers, momentum] = train("ddp", BATCH * workers, momentum)
    per_rank = run_ranks(train_cases, world, cases, world, timeout_s=300)
    for i, (strategy, workers, momentum) in enumerate(cases):
        reference, ref_steps, _, _ = references[workers, momentum]
        trained = [per_rank[r][i] for r in range(world)]
        assert [role for _, _, role, _ in trained] == ["worker"] * workers + ["server"] * (world - workers)
        for rank, (params, steps, role, divergence) in enumerate(trained[:workers]):
            assert steps == ref_steps == N_SAMPLES // (BATCH * workers), (strategy, rank)
            try:
                assert_same_parameters(reference, params)
            except AssertionError as exc:
                raise AssertionError(f"{strategy} on {world} ranks, rank {rank}: {exc}") from None
            assert divergence == 0.0, (strategy, rank, divergence)   # bitwise-identical replicas
