"""A prepared script on R ranks with per-rank batch B takes the steps of a hand-written PyTorch loop at batch R*B.

The reference below imports nothing from ddtrain: a DataLoader at batch R*B over the same
seeded sampler, two param groups (different lr, momentum, weight decay), an unused head,
gradient accumulation over 2 micro-batches, gradient-norm clipping and a StepLR stepped per
epoch. The prepared script is that same loop with ``ddtrain.prepare`` and ``model.no_sync()``
for the first micro-batch, run on 2 Gloo ranks for every synchronous strategy (ps-sync: 2
workers + 1 server, so 3 ranks); parameters must agree to 1e-5 relative. The parameter servers
run once more without clipping: with it, each worker clips its own gradient before the servers
average, where one process clips the average, so that case is an expected failure (xfail below).
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from ddtrain.sync import STRATEGIES
from helpers import assert_same_parameters
from multirank import run_ranks

N, B, ACCUMULATE, EPOCHS, CLIP = 48, 4, 2, 2, 0.5
ON_EVERY_RANK = [name for name, spec in STRATEGIES.items() if spec.synchronous and not spec.uses_servers]
WITH_SERVERS = [name for name, spec in STRATEGIES.items() if spec.synchronous and spec.uses_servers]


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(6, 12)
        self.head = torch.nn.Linear(12, 3)
        self.unused_head = torch.nn.Linear(12, 3)   # never in forward: no gradient, ever

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def problem():
    torch.manual_seed(0)
    model = TwoHeads()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))
    optimizer = torch.optim.SGD([
        {"params": model.body.parameters(), "lr": 0.2, "momentum": 0.9},
        {"params": [*model.head.parameters(), *model.unused_head.parameters()], "lr": 0.1, "weight_decay": 0.01},
    ], lr=0.1)
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(7))
    return model, optimizer, data, sampler


def train(model, optimizer, loader, no_sync=None, clip=CLIP):
    """The loop both sides run: accumulate ACCUMULATE micro-batches, clip, step; StepLR per epoch."""
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(EPOCHS):
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % ACCUMULATE == 0
            loss = F.cross_entropy(model(x), y) / ACCUMULATE
            if last or no_sync is None:
                loss.backward()
            else:
                with no_sync():
                    loss.backward()
            if last:
                if clip is not None and hasattr(optimizer, "clip_grad_norm_"):
                    optimizer.clip_grad_norm_(clip)   # zero1/zero2: the global norm over the shards (zero2 keeps no .grad)
                elif clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()
        scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def hand_written(global_batch: int, clip=CLIP) -> dict:
    model, optimizer, data, sampler = problem()
    return train(model, optimizer, DataLoader(data, batch_size=global_batch, sampler=sampler), clip=clip)


def prepared(strategies, clip=CLIP):
    """On every rank: the same loop through ddtrain.prepare, once per strategy ("server" on a server rank)."""
    import ddtrain
    out = {}
    for strategy in strategies:
        model, optimizer, data, sampler = problem()
        try:
            model, optimizer, loader = ddtrain.prepare(model, optimizer, DataLoader(data, batch_size=B, sampler=sampler),
                                                       strategy=strategy, find_unused_parameters=True)
        except SystemExit:
            out[strategy] = "server"
            continue
        out[strategy] = train(model, optimizer, loader, no_sync=model.no_sync, clip=clip)
        ddtrain.shutdown()
    return out


def test_every_synchronous_strategy_equals_a_hand_written_loop_at_the_global_batch():
    reference = hand_written(2 * B)
    results = run_ranks(prepared, 2, ON_EVERY_RANK, timeout_s=240)
    for strategy in ON_EVERY_RANK:
        for rank_results in results:
            assert set(rank_results[strategy]) == set(reference), strategy        # bare keys, no "module."
            assert_same_parameters(reference, rank_results[strategy])
            assert torch.equal(rank_results[strategy]["unused_head.weight"], reference["unused_head.weight"])


LOCAL_CLIP = pytest.mark.xfail(strict=False, reason=(
    "parameter servers average after the step: clip_grad_norm_ in the loop clips each worker's own gradient, "
    "not the mean one process clips (docs/ALGORITHMS.md, 'Clipping'; the clip as a step pre-hook registered "
    "before prepare clips the mean on the servers, tests/sync/test_ps_dropin.py)"))


@pytest.mark.parametrize("clip", [pytest.param(CLIP, marks=LOCAL_CLIP), None], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("strategy", WITH_SERVERS)
def test_parameter_servers_equal_a_hand_written_loop_at_the_global_batch(strategy, clip):
    reference = hand_written(2 * B, clip)               # 2 workers
    results = run_ranks(prepared, 3, [strategy], clip, timeout_s=240)
    assert results[2][strategy] == "server"
    for rank_results in results[:2]:
        assert_same_parameters(reference, rank_results[strategy])
