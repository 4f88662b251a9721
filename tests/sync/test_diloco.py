"""local-sgd's outer optimizer (DiLoCo), post-local-SGD warm-up and adaptive interval, on 3 Gloo ranks.

The reference is written here in plain torch: R replicas of the tiny MLP in one process, each
stepping SGD (heavy-ball 0.9) on its rank's shard of the epoch's permutation (the balanced
sharding: every R-th index), the gradients averaged over the replicas for the first W steps,
and every K steps after them either the replicas' mean or the outer Nesterov step written out
from Douillard et al. 2023 (outer gradient = mean of anchor - theta_r; b = mu*b + g;
anchor -= lr*(g + mu*b)), from which every replica restarts. ddtrain's 3 ranks must end where
the reference does, to 1e-6 relative, and log at each averaging the replicas' spread around
their mean that the reference measures (sqrt(mean_r |x_r - m|^2) / |m|). One pool call runs
every case (96 samples, batch 4, 24 steps).
"""
import copy
import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ddtrain
from ddtrain import TrainConfig, fit
from ddtrain.comm import all_reduce, traffic
from ddtrain.errors import ConfigError
from ddtrain.sync.base import SyncOptions
from ddtrain.sync.local_sgd import choose_interval
from multirank import run_ranks
from helpers import N_SAMPLES, assert_same_parameters, tiny_data as _data, tiny_model as _model

WORLD, BATCH, EPOCHS, LR, MOMENTUM, SEED = 3, 4, 3, 0.05, 0.9, 3
STEPS = EPOCHS * N_SAMPLES // (WORLD * BATCH)          # 24
CASES = [  # (options, reference's (outer lr, outer momentum, warm-up W, K))
    ({"outer_optimizer": "nesterov", "sync_every": 5}, (0.7, 0.9, 0, 5)),                      # DiLoCo's defaults
    ({"outer_optimizer": "nesterov", "outer_lr": 1.0, "outer_momentum": 0.0, "sync_every": 5}, (None, 0, 0, 5)),
    ({"outer_optimizer": "average", "sync_every": 5, "local_sgd_warmup_steps": 7}, (None, 0, 7, 5)),
    ({"outer_optimizer": "nesterov", "outer_lr": 0.5, "outer_momentum": 0.8, "sync_every": 4,
      "local_sgd_warmup_steps": 6}, (0.5, 0.8, 6, 4)),
]
ADAPTIVE = [  # comm budget tiny and bound loose: the interval doubles to the max; bound tiny: it stays at the min
    {"adaptive_interval": True, "sync_every": 1, "adaptive_comm_fraction": 1e-6, "adaptive_max_divergence": 10.0,
     "adaptive_max_interval": 8},
    {"adaptive_interval": True, "sync_every": 2, "adaptive_comm_fraction": 1e-6, "adaptive_max_divergence": 1e-9,
     "adaptive_min_interval": 2},
]


def epoch_order(epoch: int) -> torch.Tensor:
    return torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))


@functools.cache
def reference(outer_lr, outer_momentum, warmup, every) -> dict:
    """R plain replicas; ``outer_lr`` None: the replicas' plain mean at each averaging.

    {"state": replica 0's final state, "spreads": the replicas' relative spread at each averaging}.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # tiny tensors: threads only contend (12 s against 0.3 s on the loaded 2 cores)
    try:
        return _reference(outer_lr, outer_momentum, warmup, every)
    finally:
        torch.set_num_threads(threads)


def _reference(outer_lr, outer_momentum, warmup, every) -> dict:
    model, shape = _model("mlp")
    train = _data(shape).train
    replicas = [copy.deepcopy(model) for _ in range(WORLD)]
    inner = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in replicas]
    anchor = [p.detach().clone() for p in model.parameters()]
    buf = [torch.zeros_like(a) for a in anchor]
    per_rank, steps, synced = N_SAMPLES // WORLD, 0, 0
    spreads = []

    def average_or_outer_step():
        with torch.no_grad():
            replicas_now = [[p.double() for p in m.parameters()] for m in replicas]
            means = [torch.stack(ps).mean(0) for ps in zip(*replicas_now)]
            spread_sq = sum(sum((x - m).pow(2).sum() for x, m in zip(xs, means)) for xs in replicas_now) / WORLD
            spreads.append(float(spread_sq.sqrt() / sum(m.pow(2).sum() for m in means).sqrt()))
            for i, params in enumerate(zip(*(m.parameters() for m in replicas))):
                if outer_lr is None:
                    new = torch.stack(params).mean(0)
                else:
                    g = torch.stack([anchor[i] - p for p in params]).mean(0)   # the outer gradient
                    buf[i] = outer_momentum * buf[i] + g
                    anchor[i] -= outer_lr * (g + outer_momentum * buf[i])     # Nesterov
                    new = anchor[i]
                for p in params:
                    p.copy_(new)

    for epoch in range(1, EPOCHS + 1):
        order = epoch_order(epoch)
        for s in range(per_rank // BATCH):
            for r, m in enumerate(replicas):
                idx = order[r:per_rank * WORLD:WORLD][s * BATCH:(s + 1) * BATCH]
                inner[r].zero_grad()
                F.cross_entropy(m(train.x[idx]), train.y[idx]).backward()
            if steps < warmup:                     # synchronous: every replica steps on the mean gradient
                for params in zip(*(m.parameters() for m in replicas)):
                    mean = torch.stack([p.grad for p in params]).mean(0)
                    for p in params:
                        p.grad = mean.clone()
            for opt in inner:
                opt.step()
            steps += 1
            if steps == warmup:
                anchor = [p.detach().clone() for p in replicas[0].parameters()]
                synced = steps
            if steps > warmup and (steps - warmup) % every == 0:
                average_or_outer_step()
                synced = steps
    if steps > synced:
        average_or_outer_step()
    return {"state": replicas[0].state_dict(), "spreads": spreads}


def train_case(options: dict) -> tuple:
    model, shape = _model("mlp")
    config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy="local-sgd", epochs=EPOCHS,
                                   batch_size=BATCH, lr=LR, momentum=MOMENTUM, seed=SEED, val_fraction=0.0,
                                   quiet=True, check_every=1, **options)
    record = fit(model, _data(shape), config)
    mine = next(c for c in record["comm"] if c["rank"] == dist.get_rank())
    # one ring all-reduce of the model's state: what an averaging must send
    state = torch.zeros(sum(p.numel() for p in model.parameters()))
    with traffic.measure() as one:
        all_reduce(state, "ring", op="avg")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, mine, one.bytes_sent


def train_cases(cases):
    return [train_case(options) for options in cases]


@pytest.fixture(scope="module")
def trained():
    return run_ranks(train_cases, WORLD, [options for options, _ in CASES] + ADAPTIVE, timeout_s=300)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_outer_optimizer_and_warmup_take_the_steps_of_the_plain_reference(trained, case):
    options, settings = CASES[case]
    expected = reference(*settings)["state"]
    for rank in range(WORLD):
        params, mine, one_averaging = trained[rank][case]
        assert_same_parameters(expected, params, rtol=1e-6)
        lr, momentum, warmup, every = settings
        nesterov = options["outer_optimizer"] == "nesterov"
        assert (mine["outer_optimizer"], mine["outer_lr"], mine["outer_momentum"]) == (
            options["outer_optimizer"], options.get("outer_lr", 0.7 if nesterov else 1.0),
            options.get("outer_momentum", 0.9 if nesterov else 0.0))
        assert mine["local_sgd_warmup_steps"] == warmup and mine["sync_every"] == every
        averagings = math.ceil((STEPS - warmup) / every)
        assert mine["averagings"] == averagings == len(mine["averaging_log"])
        assert mine["bytes_per_averaging"] == one_averaging > 0
        assert mine["bytes_sent"] == mine["warmup_bytes_sent"] + averagings * one_averaging
        assert (mine["warmup_bytes_sent"] > 0) == (warmup > 0)
        assert [e["step"] for e in mine["averaging_log"]] == [min(s, STEPS) for s in range(warmup + every, STEPS + every, every)]


def test_the_reference_tells_nesterov_from_plain_averaging():
    with pytest.raises(AssertionError):
        assert_same_parameters(reference(0.7, 0.9, 0, 5)["state"], reference(None, 0, 0, 5)["state"], rtol=1e-6)
    with pytest.raises(AssertionError):   # and a warm-up from none
        assert_same_parameters(reference(None, 0, 7, 5)["state"], reference(None, 0, 0, 5)["state"], rtol=1e-6)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_averaging_logs_the_replicas_spread_around_their_mean(trained, case):
    """DiLoCo measures the spread around the replicas' mean (anchor minus the mean outer gradient); a sign slip there
    (anchor plus it) changes no parameter but logs, and steers --adaptive-interval by, a spread the replicas never had."""
    spreads = reference(*CASES[case][1])["spreads"]
    for rank in range(WORLD):
        log = trained[rank][case][1]["averaging_log"]
        assert len(log) == len(spreads)
        assert [e["relative_divergence"] for e in log] == pytest.approx(spreads, rel=1e-5), rank


def test_warmup_keeps_replicas_identical_then_they_drift_until_the_next_averaging(trained):
    options, (_, _, warmup, every) = CASES[2]
    checks = trained[0][2][1]["divergence"]            # checked after every step (check_every=1)
    by_step = {c["step"]: c["divergence"] for c in checks}
    assert all(by_step[s] == 0.0 for s in range(1, warmup + 1))            # bitwise identical: synchronous steps
    assert all(by_step[s] > 0.0 for s in range(warmup + 1, warmup + every))   # local steps: apart
    assert by_step[warmup + every] == 0.0                                      # the averaging: together again


def test_adaptive_interval_follows_its_rule_on_every_rank(trained):
    grows, pinned = (trained[0][len(CASES) + i][1] for i in range(2))
    for rank in range(1, WORLD):                         # every rank chose the same intervals
        assert [e["next_interval"] for e in trained[rank][len(CASES)][1]["averaging_log"]] == \
            [e["next_interval"] for e in grows["averaging_log"]]
    for options, mine in zip(ADAPTIVE, (grows, pinned)):
        log = mine["averaging_log"]
        for entry, following in zip(log, log[1:]):
            assert entry["next_interval"] == choose_interval(
                entry["interval"], entry["relative_divergence"], entry["averaging_s"], entry["step_s"],
                comm_fraction=options["adaptive_comm_fraction"], max_divergence=options["adaptive_max_divergence"],
                min_interval=options.get("adaptive_min_interval", 1), max_interval=options["adaptive_max_interval"]
                if "adaptive_max_interval" in options else 100)
            assert following["interval"] == entry["next_interval"] or following["step"] == STEPS   # the last: cut short
            assert entry["relative_divergence"] > 0 and entry["averaging_s"] > 0
            assert following["step_s"] > 0          # (the run's first interval may have no step between clocks)
    assert [e["interval"] for e in grows["averaging_log"]][:5] == [1, 2, 4, 8, 8]     # K changed during the run
    assert {e["next_interval"] for e in pinned["averaging_log"]} == {2}                # the bound holds it down


def test_choose_interval_rule():
    kw = dict(min_interval=1, max_interval=50)
    # communication: averaging 0.5 s, step 0.1 s, budget 10 %: K >= 0.5 / (0.1 * 0.1) = 50 ... capped by doubling
    assert choose_interval(10, 0.001, 0.5, 0.1, comm_fraction=0.1, max_divergence=1.0, **kw) == 20
    assert choose_interval(40, 0.001, 0.5, 0.1, comm_fraction=0.1, max_divergence=1.0, **kw) == 50
    assert choose_interval(40, 0.001, 0.3, 0.1, comm_fraction=0.1, max_divergence=1.0, **kw) == 30   # ceil(30)
    # a fast link: average often
    assert choose_interval(20, 0.001, 0.001, 0.1, comm_fraction=0.1, max_divergence=1.0, **kw) == 1
    # divergence over the bound: shrink in proportion (the bound wins over the communication budget)
    assert choose_interval(20, 0.04, 0.5, 0.1, comm_fraction=0.1, max_divergence=0.01, **kw) == 5
    assert choose_interval(20, 1.0, 0.5, 0.1, comm_fraction=0.1, max_divergence=0.01, **kw) == 1       # the min
    # nothing measured (no step time, no spread): the longest the doubling allows
    assert choose_interval(4, 0.0, 0.5, 0.0, comm_fraction=0.1, max_divergence=0.01, **kw) == 8


def test_choose_interval_rounds_the_budget_up_and_the_divergence_bound_down():
    """Where floor, round and ceil all differ: K_comm = ceil(12.3) = 13 (an interval of 12 would exceed the budget);
    K_div = floor(6.67) = 6 (7 would pass the bound) and floor(3.33) = 3."""
    kw = dict(min_interval=1, max_interval=50, comm_fraction=0.1)
    assert choose_interval(10, 0.0, 0.123, 0.1, max_divergence=1.0, **kw) == 13          # 0.123 / (0.1 x 0.1) = 12.3
    assert choose_interval(10, 0.015, 10.0, 0.1, max_divergence=0.01, **kw) == 6         # 10 x 0.01 / 0.015 = 6.67
    assert choose_interval(10, 0.03, 10.0, 0.1, max_divergence=0.01, **kw) == 3          # 10 x 0.01 / 0.03 = 3.33


def test_options_are_checked_and_refused_by_other_strategies():
    bad = [({"outer_optimizer": "average", "outer_lr": 0.5}, "outer_lr is read with outer_optimizer='nesterov'"),
           ({"outer_optimizer": "nesterov", "outer_momentum": 1.0}, "outer_momentum must be in"),
           ({"outer_optimizer": "nesterov", "outer_lr": 0.0}, "outer_lr must be positive"),
           ({"outer_optimizer": "adam"}, "outer_optimizer 'adam' is not one of: average, nesterov"),
           ({"local_sgd_warmup_steps": -1}, "local_sgd_warmup_steps must be"),
           ({"adaptive_interval": True, "sync_every": "epoch"}, "sync_every must be an integer between"),
           ({"adaptive_min_interval": 5, "adaptive_max_interval": 4}, "adaptive_min_interval must be")]
    for options, message in bad:
        with pytest.raises(ConfigError, match=message):
            SyncOptions(**options)
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for strategy, option in (("ddp", {"outer_optimizer": "nesterov"}), ("hybrid", {"adaptive_interval": True}),
                             ("ring", {"local_sgd_warmup_steps": 3})):
        with pytest.raises(ddtrain.DDTrainError, match=rf"{next(iter(option))} is read only by local-sgd, "
                                                       rf"not by strategy '{strategy}'"):
            ddtrain.prepare(model, sgd, strategy=strategy, **option)


def test_command_line_names_the_flag(capsys):
    from ddtrain.cli import main
    assert main(["train", "--strategy", "local-sgd", "--outer-lr", "0.5", "--steps", "1"]) != 0
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--outer-lr" in errors[0] and "outer_optimizer='nesterov'" in errors[0], errors


def test_one_process_outer_step_and_a_loaded_state_restarts_the_interval():
    """The outer step by hand on one replica (world size 1: the mean is the replica), and ``load_state_dict`` re-anchors."""
    from ddtrain.sync.local_sgd import LocalSGDStrategy
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    strategy = LocalSGDStrategy(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                SyncOptions(outer_optimizer="nesterov", sync_every=2))
    anchor = [p.detach().clone() for p in model.parameters()]
    buf = [torch.zeros_like(a) for a in anchor]
    for _ in range(2):                                    # two averagings of two "local steps" each
        for _ in range(2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            local = [p.detach().clone() for p in model.parameters()]
            strategy.after_step(0)
        for i, x in enumerate(local):
            g = anchor[i] - x
            buf[i] = 0.9 * buf[i] + g
            anchor[i] = anchor[i] - 0.7 * (g + 0.9 * buf[i])
        for a, p in zip(anchor, model.parameters()):
            assert torch.allclose(a, p, rtol=0, atol=1e-6)
    loaded = {k: v + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)
    assert all(torch.equal(a, p) for a, p in zip(strategy.anchor, model.parameters()))
    strategy.update_stats()
    assert strategy.stats.extra["averagings"] == 2 and strategy.stats.extra["outer_lr"] == 0.7
