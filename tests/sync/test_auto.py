"""``--strategy auto``: which methods it may try, and that it trains what the method it commits to trains.

The multi-rank test runs auto on 3 Gloo ranks (a 7-11-3 MLP, 5 samples a rank: nothing a power of two)
with the default eligibility, snapshotting the parameters and the optimizer's state before every
step. Two independent references: (1) the method auto committed to, run as a fixed strategy
(``ddtrain.sync.wrap`` of its name and options) from the snapshot at the step auto switched to it,
must end at auto's parameters (1e-5); (2) a plain single-process ``torch.optim.SGD`` loop on the
global batch of 15, written here, from the same initial model, must end there too: every exact
method takes that step, so the trials and every handover before the commit changed nothing.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ddtrain.costmodel import advise
from ddtrain.costmodel.risks import Risk
from ddtrain.errors import ConfigError
from ddtrain.sync import SyncOptions, check_options
from ddtrain.sync import auto
from helpers import assert_same_parameters
from multirank import run_ranks

WORLD, BATCH, STEPS, LR, MOMENTUM = 3, 5, 24, 0.1, 0.9


def _model():
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 3))


def _data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(STEPS, WORLD * BATCH, 7, generator=g), torch.randint(0, 3, (STEPS, WORLD * BATCH), generator=g)


def _steps(strategy, model, optimizer, x, y, rank, first, last, snapshots=None):
    for step in range(first, last):
        if snapshots is not None:
            snapshots[step] = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                               copy.deepcopy(optimizer.state_dict()))
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        F.cross_entropy(strategy.model(x[step, mine]), y[step, mine]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        strategy.after_step(step)


def auto_then_fixed(trial_steps: int, candidates: int):
    """Rank function: auto for STEPS steps, then the committed method from auto's state at its switch step."""
    import torch.distributed as dist
    from ddtrain.sync import wrap
    rank = dist.get_rank()
    x, y = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    strategy = wrap("auto", model, optimizer, SyncOptions(auto_trial_steps=trial_steps, auto_candidates=candidates))
    snapshots = {}
    _steps(strategy, model, optimizer, x, y, rank, 0, STEPS, snapshots)
    strategy.finish()
    record = strategy.run_record()
    auto_params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    since = record["choice"]["since_step"]
    chosen = next(t for t in record["trials"] if t["label"] == record["choice"]["label"])
    args = chosen["train_args"]
    name = args[args.index("--strategy") + 1]
    compression = args[args.index("--compression") + 1] if "--compression" in args else "none"
    fixed_model = _model()
    fixed_model.load_state_dict(snapshots[since][0])
    fixed_optimizer = torch.optim.SGD(fixed_model.parameters(), lr=LR, momentum=MOMENTUM)
    fixed_optimizer.load_state_dict(snapshots[since][1])
    fixed = wrap(name, fixed_model, fixed_optimizer, SyncOptions(compression=compression))
    _steps(fixed, fixed_model, fixed_optimizer, x, y, rank, since, STEPS)
    fixed.finish()
    return {"auto": auto_params, "fixed": {k: v.detach().clone() for k, v in fixed_model.state_dict().items()},
            "record": {k: record[k] for k in ("choice", "trials", "switches", "allow")}}


def plain_reference() -> dict:
    """One process, the global batch of WORLD * BATCH every step: the step every exact method takes."""
    x, y = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        F.cross_entropy(model(x[step]), y[step]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


@pytest.mark.slow
def test_auto_trains_what_the_committed_method_trains_from_its_switch():
    results = run_ranks(auto_then_fixed, WORLD, 2, 3, timeout_s=300)
    reference = plain_reference()
    for r in results:
        record = r["record"]
        assert record["allow"] == []
        assert len(record["trials"]) == 3
        assert all("--compression" not in t["train_args"] and "--sync-every" not in t["train_args"]
                   for t in record["trials"]), record["trials"]   # exact methods only by default
        assert len(record["switches"]) >= 3                          # start, two trials (and maybe the commit)
        assert record["choice"]["since_step"] <= record["choice"]["step"] < STEPS
        assert_same_parameters(r["fixed"], r["auto"])
        assert_same_parameters(reference, r["auto"])
    assert all(r["record"]["choice"] == results[0]["record"]["choice"] for r in results)   # every rank chose alike


def local_sgd_then_ddp():
    """Rank function: local SGD (K=4, DiLoCo's outer step) for 6 steps, a handover to ddp mid-interval, 3 ddp steps."""
    import torch.distributed as dist
    from ddtrain.sync import wrap
    rank = dist.get_rank()
    x, y = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    strategy = wrap("auto", model, optimizer, SyncOptions(auto_allow="local-sgd"))
    strategy._switch_to(advise.Method(strategy="local-sgd", algorithm="ring", kind="average", sync_every=4,
                                      outer="nesterov"), "test")
    _steps(strategy, model, optimizer, x, y, rank, 0, 6)
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    strategy._switch_to(advise.Method(strategy="ddp", algorithm="native", kind="gradient"), "test")
    handed = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    _steps(strategy, model, optimizer, x, y, rank, 6, 9)
    strategy.finish()
    return {"before": momentum, "handed": handed, "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.slow
def test_leaving_local_sgd_hands_over_one_state():
    """The ranks' own momentum after local steps is averaged at the handover; ddp then keeps the replicas equal."""
    results = run_ranks(local_sgd_then_ddp, WORLD, timeout_s=120)
    assert any(not torch.equal(a, b) for a, b in zip(results[0]["before"], results[1]["before"]))   # local: apart
    mean = [sum(r["before"][i] for r in results) / WORLD for i in range(len(results[0]["before"]))]
    for r in results:
        for got, want in zip(r["handed"], mean):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
        for got, want in zip(r["params"], results[0]["params"]):
            assert torch.equal(got, want)


def _prediction(label_strategy, compression="none", kind="gradient", step_s=1.0, points=0.0, sync_every=1):
    method = advise.Method(strategy=label_strategy, algorithm=label_strategy, kind=kind, compression=compression,
                           sync_every=sync_every, outer="nesterov" if kind == "average" else "average")
    p = advise.Prediction(method=method, step_s=step_s, comm_s=0, codec_s=0, bytes_per_step=0, collectives_per_step=0,
                          risk=Risk(points=points, basis="ours", source="test"))
    p.eligible = points is not None and points <= 1.0
    return p


def test_default_eligibility_tries_exact_methods_only():
    ranked = [_prediction("ddp", "powersgd:4:2", step_s=0.1), _prediction("local-sgd", kind="average", step_s=0.2,
                                                                          sync_every=20),
              _prediction("ring", step_s=0.5), _prediction("ddp", step_s=0.6), _prediction("tree", step_s=0.7),
              _prediction("butterfly", step_s=0.8)]
    assert [p.method.strategy for p in auto.choose_trials(ranked, (), 3)] == ["ring", "ddp", "tree"]
    # allowed families get a place each (their fastest), then the next fastest of any; none predicted more than
    # PRUNE_FACTOR times the fastest (ring at 0.5 s against 0.1 s)
    picked = auto.choose_trials(ranked, ("powersgd", "local-sgd"), 3)
    assert [(p.method.strategy, p.method.compression) for p in picked] == [("ddp", "powersgd:4:2"), ("local-sgd", "none")]
    near = [_prediction("ddp", "powersgd:4:2", step_s=0.3), _prediction("local-sgd", kind="average", step_s=0.35,
                                                                        sync_every=20), *ranked[2:]]
    assert [(p.method.strategy, p.method.compression) for p in auto.choose_trials(near, ("powersgd", "local-sgd"), 3)] \
        == [("ddp", "powersgd:4:2"), ("local-sgd", "none"), ("ring", "none")]
    # a risk not known within the bound is never tried, allowed or not
    risky = [_prediction("ddp", "topk:0.1", step_s=0.01, points=None), _prediction("ddp", step_s=1.0)]
    assert [p.method.compression for p in auto.choose_trials(risky, ("topk",), 3)] == ["none"]


def test_allow_words_and_settings_are_checked():
    with pytest.raises(ConfigError) as error:
        check_options("auto", SyncOptions(auto_allow="powersgd,lossy"))
    assert error.value.field == "auto_allow" and "lossy" in str(error.value)
    with pytest.raises(ConfigError):
        check_options("auto", SyncOptions(auto_recheck=1.0))
    with pytest.raises(ConfigError) as error:
        check_options("ddp", SyncOptions(auto_candidates=2))   # auto's settings are auto's
    assert error.value.field == "auto_candidates"
    check_options("auto", SyncOptions(auto_allow="local-sgd, powersgd", auto_recheck=0))


def test_method_options_run_the_method_alone():
    average = advise.Method(strategy="local-sgd", algorithm="ring", kind="average", sync_every=20, outer="nesterov")
    options = auto.method_options(SyncOptions(auto_allow="local-sgd", auto_trial_steps=2), average)
    assert (options.sync_every, options.outer_optimizer, options.auto_allow, options.auto_trial_steps) == \
        (20, "nesterov", "", SyncOptions().auto_trial_steps)
    check_options("local-sgd", options)
    gradient = advise.Method(strategy="ring", algorithm="ring", kind="gradient", compression="fp16")
    options = auto.method_options(SyncOptions(auto_allow="fp16"), gradient)
    assert (options.compression, options.sync_every) == ("fp16", 1)
    check_options("ring", options)


def test_compute_timing_leaves_no_trace():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.BatchNorm1d(9), nn.Dropout(0.3), nn.Linear(9, 2))
    x = torch.randn(10, 6)
    model(x).sum().backward()          # gradients already there, as inside gradient accumulation
    before = copy.deepcopy(model.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    assert auto.compute_seconds(model, (x,), {}) > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # BatchNorm's statistics
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state())


def prepared_script():
    """A prepare() script with strategy="auto": what it trains, and auto's record read from the prepared model."""
    import ddtrain
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data = TensorDataset(torch.randn(120, 7, generator=torch.Generator().manual_seed(1)),
                         torch.randint(0, 3, (120,), generator=torch.Generator().manual_seed(2)))
    model, optimizer, loader = ddtrain.prepare(model, optimizer, DataLoader(data, batch_size=BATCH), strategy="auto",
                                               auto_trial_steps=2, auto_candidates=2)
    for _ in range(2):   # 8 steps a pass
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    record = model.strategy.run_record()
    ddtrain.shutdown()
    return [p.detach().clone() for p in model.module.parameters()], record["choice"], len(record["trials"])


@pytest.mark.slow
def test_prepare_path_chooses_and_keeps_the_replicas_equal():
    results = run_ranks(prepared_script, WORLD, timeout_s=180)
    for params, choice, trials in results:
        assert choice is not None and choice == results[0][1] and trials == 2
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0]))


def test_drift_is_a_moved_wait_not_noise():
    # compute 100 ms; the choice measured 300 ms (wait 200 ms)
    assert auto.drifted(0.420, 0.300, 0.100, 1.5) == (True, pytest.approx(1.6))     # link slower: wait x1.6
    assert auto.drifted(0.210, 0.300, 0.100, 1.5) == (True, pytest.approx(0.55))    # link faster: wait x0.55
    assert not auto.drifted(0.380, 0.300, 0.100, 1.5)[0]                            # x1.4: within the factor
    # a tiny wait (1 ms -> 3 ms) triples, but the step moved by 2 %: noise
    assert not auto.drifted(0.103, 0.101, 0.100, 1.5)[0]
