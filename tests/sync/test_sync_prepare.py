"""The minimal-change path (``ddtrain.prepare`` + ``ddtrain.shutdown``) with the strategies that need a last word.

A script on this path never calls ``finish``; ``ddtrain.shutdown()`` does it for them: the
parameter-server workers send STOP (else their server would wait for them until its timeout)
and receive the final parameters, and local SGD averages a last time. Every worker therefore
ends with the same parameters, and a server rank returns from ``prepare`` only to exit.
"""
import torch
from torch.utils.data import DataLoader, TensorDataset

import ddtrain
from ddtrain.sync import STRATEGIES
from multirank import run_ranks

# parameter servers (their workers' STOP) and local SGD (its last averaging)
NEED_A_LAST_WORD = [name for name, spec in STRATEGIES.items() if spec.uses_servers] + ["local-sgd"]


def user_script(strategy):
    """What a user writes, plus a look at the result: (role, parameters) or ("server", None)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(96, 8, generator=torch.Generator().manual_seed(1)),
                         torch.randint(0, 2, (96,), generator=torch.Generator().manual_seed(2)))
    try:
        options = {"sync_every": 5} if STRATEGIES[strategy].periodic else {}   # others refuse it
        model, optimizer, loader = ddtrain.prepare(model, optimizer, DataLoader(data, batch_size=8),
                                                   strategy=strategy, **options)
    except SystemExit as exc:        # a server rank: prepare served, then ended the process
        return "server", exc.code
    for _ in range(2):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    ddtrain.shutdown()
    return "worker", [p.detach().clone() for p in model.module.parameters()]


def test_shutdown_finishes_the_strategies_that_need_it():
    for strategy in NEED_A_LAST_WORD:
        results = run_ranks(user_script, 3, strategy, timeout_s=120)
        workers = [params for role, params in results if role == "worker"]
        uses_servers = STRATEGIES[strategy].uses_servers
        if uses_servers:
            assert results[2] == ("server", 0)
        assert len(workers) == (2 if uses_servers else 3)
        for params in workers[1:]:
            assert all(torch.equal(a, b) for a, b in zip(workers[0], params)), strategy
