"""``--balance``: unequal shares of the global batch take the same steps as equal shares and as a plain loop.

The multi-rank test forces shares (3 ranks, unequal, changed in the middle of an epoch) through
the balancer's own schedule, so the arithmetic is tested without depending on measured speeds;
the reference is the plain PyTorch loop over the global batch written in tests/helpers.py and the
equal-share run. The share arithmetic (``ddtrain.data.balance``) is tested as pure functions.
"""
from __future__ import annotations

import pytest
import torch

from ddtrain import Callback, TrainConfig
from ddtrain.data.balance import (ShareSchedule, micro_sizes, predicted_step_s, proportional_shares, rank_span,
                                  uniform_shares)
from ddtrain.errors import ConfigError, DDTrainError
from helpers import N_SAMPLES, assert_same_parameters, plain_sgd, tiny_data, tiny_model, train_and_return_parameters
from multirank import run_ranks

SEED, EPOCHS, GLOBAL = 3, 2, 24          # train_and_return_parameters: lr 0.1, momentum 0.9, seed 3


# ---- the share arithmetic ----

@pytest.mark.parametrize("speeds,total,minimum", [([1.0, 1.0, 1.0], 24, 1), ([4.0, 1.0], 64, 1),
                                                  ([1.0, 0.5, 0.25], 100, 2), ([3.0, 1e-6, 2.0, 5.0], 7, 1),
                                                  ([1.0, 2.0, 3.0, 4.0, 5.0], 1001, 3)])
def test_shares_are_integers_summing_to_the_total_and_at_least_the_minimum(speeds, total, minimum):
    shares = proportional_shares(speeds, total, minimum=minimum)
    assert sum(shares) == total and all(isinstance(n, int) and n >= minimum for n in shares)
    ideal = [total * s / sum(speeds) for s in speeds]
    for n, target in zip(shares, ideal):   # proportional, up to rounding, where the minimum does not bind
        assert n == minimum or abs(n - target) < 1


def test_shares_move_by_at_most_max_change_and_converge():
    previous, speeds = uniform_shares(120, 3), [4.0, 2.0, 1.0]
    path = [previous]
    for _ in range(6):
        shares = proportional_shares(speeds, 120, minimum=1, previous=path[-1], max_change=10)
        assert sum(shares) == 120 and max(abs(a - b) for a, b in zip(shares, path[-1])) <= 10
        path.append(shares)
    assert path[-1] == proportional_shares(speeds, 120, minimum=1) == [69, 34, 17]


def test_shares_are_a_pure_function_of_the_gathered_speeds():
    speeds = [0.1 + 0.37 * r for r in range(7)]
    first = proportional_shares(speeds, 997, minimum=2, previous=uniform_shares(997, 7), max_change=40)
    assert all(proportional_shares(list(speeds), 997, minimum=2, previous=uniform_shares(997, 7), max_change=40)
               == first for _ in range(5))


def test_an_unmeasured_rank_keeps_the_previous_shares():
    assert proportional_shares([1.0, float("nan")], 10, previous=[3, 7]) == [3, 7]
    assert proportional_shares([1.0, 0.0], 10) == [5, 5]


def test_uniform_micro_sizes_span_and_prediction():
    assert uniform_shares(10, 3) == [4, 3, 3] and micro_sizes(7, 3) == [3, 2, 2]
    assert rank_span([5, 12, 7], 2) == (17, 7)
    assert predicted_step_s([2, 6], [0.5, 0.25]) == 1.5


def test_a_schedule_refuses_a_change_for_a_step_already_drawn():
    schedule = ShareSchedule([4, 4])
    assert schedule.shares_for(3) == [4, 4]
    schedule.change(4, [6, 2])
    assert schedule.shares_for(3) == [4, 4] and schedule.shares_for(9) == [6, 2]
    with pytest.raises(DDTrainError, match="already drew step 9"):
        schedule.change(9, [5, 3])


def test_speed_needs_a_global_batch_and_a_synchronous_strategy():
    from ddtrain.training import balance
    ok = dict(synchronous=True, strategy="ddp", global_batch=24, workers=3, grad_accum=2, sharding="balanced")
    balance.check("speed", **ok)
    for change, field_text in (({"global_batch": 0}, "--global-batch-size"), ({"synchronous": False}, "synchronous"),
                               ({"grad_accum": 9}, "at least grad_accum"), ({"sharding": "contiguous"}, "sharding")):
        with pytest.raises(ConfigError, match=field_text):
            balance.check("speed", **{**ok, **change})


# ---- 3 ranks: forced unequal shares against equal shares and the plain loop ----

class ForceShares(Callback):
    """Shares [5, 12, 7] from the start, [10, 3, 11] from step 2 (the middle of the first epoch) on."""

    def on_train_begin(self, state):
        if state.balancer is None:   # a parameter server
            return
        state.balancer.schedule.change(0, [5, 12, 7] if state.config.recipe.grad_accum == 1 else [6, 12, 6])

    def on_step_end(self, step, logs, state):
        if step == 1 and state.balancer is not None:
            state.balancer.schedule.change(2, [10, 3, 11] if state.config.recipe.grad_accum == 1 else [10, 4, 10])


def train_with_forced_shares(strategy: str, grad_accum: int):
    model, shape = tiny_model("simple-cnn")
    config = TrainConfig.from_flat(model="simple-cnn", data="synthetic", strategy=strategy, epochs=EPOCHS,
                                   global_batch_size=GLOBAL, grad_accum=grad_accum, balance="speed",
                                   balance_every=1000, lr=0.1, momentum=0.9, seed=SEED, val_fraction=0.0, quiet=True)
    from ddtrain import fit
    record = fit(model, tiny_data(shape), config, callbacks=[ForceShares()])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, record.get("balance", {}).get("final_shares")


def plain_loop() -> dict:
    model, shape = tiny_model("simple-cnn")
    train = tiny_data(shape).train
    return plain_sgd(model, train.x, train.y, lr=0.1, momentum=0.9, epochs=EPOCHS, global_batch=GLOBAL,
                     epoch_order=lambda epoch: torch.randperm(
                         N_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch)))


@pytest.mark.slow   # 20-30 s each on the 2-core machine: four process groups of 3-4 ranks
@pytest.mark.parametrize("strategy,grad_accum", [("ddp", 1), ("ring", 2), ("ps-sync", 1)])
def test_unequal_shares_take_the_steps_of_equal_shares_and_of_a_plain_loop(strategy, grad_accum):
    world = 4 if strategy == "ps-sync" else 3       # ps-sync: 3 workers and its server
    results = run_ranks(train_with_forced_shares, world, strategy, grad_accum)
    workers = results[:3]
    reference = plain_loop()
    uniform = run_ranks(train_and_return_parameters, 3, "simple-cnn", GLOBAL // 3)[0][0]
    for params, shares in workers:
        assert shares == ([10, 3, 11] if grad_accum == 1 else [10, 4, 10])
        assert_same_parameters(reference, params)
        assert_same_parameters(uniform, params)


# ---- measured: a rank made slow gets a smaller share, the step stays the plain loop's ----

def train_with_a_slow_rank(mode: str):
    import time
    import torch.distributed as dist
    model, shape = tiny_model("simple-cnn")
    if dist.get_rank() == 1:   # 3 ms per sample more on rank 1, inside its forward (its local work)
        model.register_forward_pre_hook(lambda module, inputs: time.sleep(0.003 * inputs[0].shape[0]))
    config = TrainConfig.from_flat(model="simple-cnn", data="synthetic", strategy="ddp", steps=12,
                                   global_batch_size=GLOBAL, balance=mode, balance_every=2, lr=0.1, momentum=0.9,
                                   seed=SEED, val_fraction=0.0, quiet=True)
    from ddtrain import fit
    record = fit(model, tiny_data(shape), config)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, record["balance"]


@pytest.mark.slow   # two 3-rank runs of 12 steps
def test_a_slow_rank_gets_a_smaller_share_and_the_step_stays_the_same():
    model, shape = tiny_model("simple-cnn")
    train = tiny_data(shape).train
    reference = plain_sgd(model, train.x, train.y, lr=0.1, momentum=0.9, epochs=3, global_batch=GLOBAL,
                          epoch_order=lambda epoch: torch.randperm(
                              N_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch)))
    for mode in ("measure", "speed"):
        results = run_ranks(train_with_a_slow_rank, 3, mode)
        records = [r[1] for r in results]
        assert all(r == records[0] for r in records)   # every rank agreed on the same shares, from the same numbers
        balance = records[0]
        assert balance["straggler"]["slowest_rank"] == 1
        if mode == "measure":
            assert balance["final_shares"] == [8, 8, 8] and balance["straggler"]["balancing_gain"] > 1
        else:
            assert balance["final_shares"][1] < min(balance["final_shares"][0], balance["final_shares"][2])
            assert any("new_shares" in h for h in balance["history"])
        for params, _ in results:
            assert_same_parameters(reference, params)


def test_prepare_refuses_balance_in_one_message():
    from ddtrain import prepare
    with pytest.raises(DDTrainError, match="not supported yet.*docs/BALANCE.md"):
        prepare(torch.nn.Linear(2, 2), None, balance="speed")


def test_train_refuses_speed_with_an_asynchronous_strategy_in_one_line():
    from helpers import assert_one_clear_error, ddtrain
    result = ddtrain("train", "--strategy", "local-sgd", "--nproc", "2", "--global-batch-size", "64",
                     "--balance", "speed", "--steps", "2")
    assert_one_clear_error(result, "--balance", "synchronous")


# ---- elastic resume: the shares are not training state ----

class ForceGiven(Callback):
    def __init__(self, shares):
        self.shares = shares

    def on_train_begin(self, state):
        state.balancer.schedule.change(0, self.shares)


def train_resumable(directory: str, steps: int, shares: list[int], resume: bool):
    model, shape = tiny_model("simple-cnn")
    config = TrainConfig.from_flat(model="simple-cnn", data="synthetic", strategy="ddp", steps=steps,
                                   global_batch_size=GLOBAL, balance="speed", balance_every=1000, lr=0.1, momentum=0.9,
                                   seed=SEED, val_fraction=0.0, quiet=True, checkpoint_dir=directory,
                                   checkpoint_every=2, resume=resume)
    from ddtrain import fit
    record = fit(model, tiny_data(shape), config, callbacks=[ForceGiven(shares)])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, record["reliability"]["resumed_from"]


@pytest.mark.slow   # a 3-rank run stopped at step 6, resumed on 2 ranks with other shares
def test_a_balanced_run_resumed_on_fewer_workers_with_other_shares_takes_the_same_steps(tmp_path):
    run_ranks(train_resumable, 3, str(tmp_path), 6, [5, 12, 7], False)
    resumed = run_ranks(train_resumable, 2, str(tmp_path), 8, [17, 7], True)
    reference = plain_loop()   # 2 epochs of 4 steps = 8 steps
    for params, resumed_from in resumed:
        assert resumed_from is not None and resumed_from["step"] == 6, resumed_from
        assert_same_parameters(reference, params)
