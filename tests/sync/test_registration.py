"""An all-reduce algorithm and a strategy added from outside the package: one registration call each.

The toy algorithm all-gathers every rank's tensor and sums the pieces in rank order, so it must
equal torch.distributed's all-reduce; the toy strategy averages every gradient with it right
after backward, so 2 ranks x batch 8 must take the steps of a plain PyTorch loop with batch 16.
Registrations happen inside each rank's function (the ranks are separate processes) and are
removed in a ``finally``, so the pooled processes and other tests see the registries unchanged.
"""
import pytest
import torch
import torch.distributed as dist

import ddtrain
from ddtrain import comm
from ddtrain.comm import Algorithm, register_algorithm
from ddtrain.costmodel import LinkParams, predict_time
from ddtrain.sync import STRATEGIES, Strategy, StrategySpec, register_strategy
from helpers import assert_same_parameters, train_and_return_parameters
from multirank import run_ranks

ALGORITHM, STRATEGY = "toy-gather-sum", "toy-average"
WORLD, BATCH, EPOCHS, SAMPLES = 2, 8, 2, 96


def gather_sum_(tensor, op="sum", group=None, *, timeout_s=None):
    """All-reduce by all-gather, then a sum in rank order (sum only: a toy)."""
    if op != "sum":
        raise ValueError(f"{ALGORITHM} only sums, got op={op!r}")
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return tensor.copy_(total)


def gather_sum_time(nbytes, ranks, alpha, beta, gamma=0.0):
    """Every rank receives p-1 whole buffers, one after another, and adds them."""
    return 0.0 if ranks == 1 or nbytes == 0 else (ranks - 1) * (alpha + nbytes * beta + nbytes * gamma)


class GradientAveraging(Strategy):
    """Average each gradient over the ranks with the toy all-reduce as soon as backward has written it."""

    def __init__(self, model, optimizer, options):
        for tensor in model.state_dict().values():      # every rank starts from rank 0's state
            dist.broadcast(tensor, 0)
        super().__init__(model, optimizer)
        self.hooks = [p.register_post_accumulate_grad_hook(self.average_) for p in model.parameters()]

    def average_(self, parameter):
        comm.all_reduce(parameter.grad, ALGORITHM).div_(dist.get_world_size())

    def close(self):
        for hook in self.hooks:
            hook.remove()


def registered(fn, *args):
    """Run ``fn`` with the toy algorithm and strategy registered, and unregistered afterwards."""
    register_algorithm(Algorithm(name=ALGORITHM, all_reduce=gather_sum_, time=gather_sum_time))
    register_strategy(StrategySpec(name=STRATEGY, build=GradientAveraging, algorithm=ALGORITHM,
                                   summary="gradients averaged with the toy all-reduce after backward"))
    try:
        return fn(*args)
    finally:
        del comm.ALGORITHMS[ALGORITHM], STRATEGIES[STRATEGY]


def problem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g)


def train_plain(model, optimizer, x, y, batch, rank=0, world=1):
    """The global batches in order; this rank takes its contiguous part of each."""
    global_batch = batch * world
    for _ in range(EPOCHS):
        for start in range(0, SAMPLES, global_batch):
            lo = start + rank * batch
            loss = torch.nn.functional.cross_entropy(model(x[lo:lo + batch]), y[lo:lo + batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def toy_all_reduce_and_prepare():
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(10 + rank)
    checks = []
    for tensor in (torch.randn(7, generator=g, dtype=torch.float64), torch.randint(-9, 9, (3, 5), generator=g),
                   torch.randn(0)):
        expected = tensor.clone()
        dist.all_reduce(expected)
        checks.append(torch.equal(comm.all_reduce(tensor.clone(), ALGORITHM), expected))
    model, x, y = problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, _ = ddtrain.prepare(model, optimizer, strategy=STRATEGY)
    params = train_plain(model, optimizer, x, y, BATCH, rank, dist.get_world_size())
    ddtrain.shutdown()                                  # finishes the strategy: its hooks are removed
    return checks, params


def test_a_registered_algorithm_and_strategy_train_like_plain_pytorch():
    model, x, y = problem()
    reference = train_plain(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), x, y, BATCH * WORLD)
    results = run_ranks(registered, WORLD, toy_all_reduce_and_prepare)
    for checks, params in results:
        assert all(checks), checks                      # equals torch.distributed's all-reduce, bit for bit
        assert_same_parameters(reference, params)
    assert all(torch.equal(results[0][1][k], results[1][1][k]) for k in reference)   # identical replicas


def test_a_registered_strategy_is_usable_by_name_in_fit():
    reference, ref_steps = train_and_return_parameters("mlp", BATCH * WORLD)
    for params, steps in run_ranks(registered, WORLD, train_and_return_parameters, "mlp", BATCH, STRATEGY):
        assert steps == ref_steps
        assert_same_parameters(reference, params)


def test_registration_adds_the_cost_formula_and_cleans_up():
    params = LinkParams(alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-10)
    predicted = registered(predict_time, ALGORITHM, 1000, 4, params)
    assert predicted == pytest.approx(3 * (1e-5 + 1000 * 1e-9 + 1000 * 1e-10))
    assert ALGORITHM not in comm.ALGORITHMS and STRATEGY not in STRATEGIES
    with pytest.raises(ddtrain.DDTrainError, match="unknown"):
        comm.all_reduce(torch.ones(2), ALGORITHM)
