"""ddtrain.save_state / load_state / stop_requested on Gloo ranks (issue 28, item 2).

The reference is the same prepare() loop run without a break. A run that saves mid-epoch at step
K and a new run that loads it must end with the same parameters, to the bit at the same size, and
beyond the parameters: the loader yields exactly the batches not yet trained (the sample indices
are recorded), the RNG streams go on (dropout masks, and torch/numpy/Python draws after the
run), the LR schedule, a registered object's state and the optimizer step count continue. At
another world size with a global batch the parameters agree to 1e-5. Bad input: a state of
another model (refused naming the parameter), a damaged newest file (named, the one before it
loaded), only damaged files (named, nothing loaded), a ddtrain train checkpoint directory.
"""
import os
import random
import signal

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from multirank import run_ranks

N = 60            # samples; 30 a rank on 2 ranks, batches of 4: 8 steps an epoch (the last of 2 samples)


class Indexed(Dataset):
    """Sample i is (x_i, y_i, i): the index says which samples a rank trained."""

    def __init__(self, n=N):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class Counter:
    """A user object registered for checkpointing."""

    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def train(directory=None, *, stop_after=None, load=False, epochs=3, hidden=8, dropout=0.25, global_batch=None,
          strategy=None, options=None, signal_at=None, auto=False):
    """One rank's prepare() loop; returns what it trained and its final state."""
    import ddtrain
    from ddtrain.training.state import Preempted
    ddtrain.init()
    torch.manual_seed(0)
    # a check at every step: this run's steps take milliseconds, and the default spacing (about 0.2 s of
    # training, up to 1,000 steps) could let it end before any check
    os.environ["DDTRAIN_PREEMPT_CHECK_S"] = "0"
    np.random.seed(ddtrain.rank())
    random.seed(ddtrain.rank())
    model = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                                torch.nn.Linear(hidden, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(Indexed(), batch_size=4, shuffle=True)
    counter = Counter()
    model, optimizer, loader = ddtrain.prepare(
        model, optimizer, loader, strategy=strategy, checkpoint_dir=directory if auto else False,
        global_batch_size=global_batch, **(options or {}))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.5)
    ddtrain.register_for_checkpointing(counter)
    state = ddtrain.load_state(directory) if load else None
    seen, lrs = [], []
    try:
        for epoch in range(state.epoch if state else 0, epochs):
            loader.set_epoch(epoch)
            for x, y, index in loader:
                seen.append(index.tolist())
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
                counter.seen += len(index)
                lrs.append(scheduler.get_last_lr()[0])
                steps = optimizer._ddtrain_counter.steps
                if signal_at is not None and steps == signal_at[0] and ddtrain.rank() == signal_at[1]:
                    os.kill(os.getpid(), signal.SIGTERM)   # noted by the handler; every rank stops at a later step
                if not auto and signal_at is not None and ddtrain.stop_requested():
                    ddtrain.save_state(directory)
                    raise Preempted(0)
                if stop_after is not None and steps == stop_after:
                    ddtrain.save_state(directory)
                    raise Preempted(0)
    except Preempted:
        out = {"stopped_at": optimizer._ddtrain_counter.steps, "seen": seen}
        ddtrain.shutdown()
        return out
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {"params": params, "seen": seen, "lrs": lrs, "counter": counter.seen, "steps": optimizer._ddtrain_counter.steps,
           "state": None if state is None else (state.step, state.epoch, state.world_size_was),
           "draws": (torch.rand(2).tolist(), float(np.random.rand()), random.random())}
    ddtrain.shutdown()
    return out


def test_a_run_saved_mid_epoch_and_loaded_goes_on_as_the_uninterrupted_one(tmp_path):
    reference = run_ranks(train, 2)
    stopped = run_ranks(train, 2, str(tmp_path), stop_after=10)         # epoch 1, 2 of its 8 steps done
    resumed = run_ranks(train, 2, str(tmp_path), load=True)
    for rank in range(2):
        ref, first, then = reference[rank], stopped[rank], resumed[rank]
        assert first["stopped_at"] == 10 and then["state"] == (10, 1, 2)
        # the loader: exactly the batches not yet trained, in the same order
        assert first["seen"] + then["seen"] == ref["seen"]
        for key, value in ref["params"].items():
            assert torch.equal(then["params"][key], value), key          # dropout's RNG went on: the same bits
        assert then["lrs"] == ref["lrs"][10:] and then["counter"] == ref["counter"] and then["steps"] == ref["steps"]
        assert then["draws"] == ref["draws"]                             # torch, numpy, Python streams continue
    assert reference[0]["draws"] != reference[1]["draws"]                # per-rank streams (each rank its own)


def test_a_stop_signal_on_one_rank_stops_every_rank_at_the_same_step_with_the_state_saved(tmp_path):
    # ring: on 3 ranks a restarted DDP's first step is bit-exact only through ddtrain's hook (HookState's
    # replay of the saved buckets); native ddp's own first step sums in another order (last bits)
    reference = run_ranks(train, 3, strategy="ring")
    stopped = run_ranks(train, 3, str(tmp_path), signal_at=(8, 1), auto=True, strategy="ring")   # SIGTERM to rank 1
    steps = {r["stopped_at"] for r in stopped}
    assert len(steps) == 1 and steps.pop() >= 8
    # an unmodified script: the state is loaded before its loader's first batch, epoch 0 passes with none
    resumed = run_ranks(train, 3, str(tmp_path), auto=True, strategy="ring")
    for rank in range(3):
        assert stopped[rank]["seen"] + resumed[rank]["seen"] == reference[rank]["seen"]
        for key, value in reference[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][key], value), key
        assert resumed[rank]["draws"] == reference[rank]["draws"]


def test_the_script_that_asks_stop_requested_saves_itself(tmp_path):
    stopped = run_ranks(train, 2, str(tmp_path), signal_at=(3, 0))
    assert stopped[0]["stopped_at"] == stopped[1]["stopped_at"] >= 3
    resumed = run_ranks(train, 2, str(tmp_path), load=True)
    reference = run_ranks(train, 2)
    for key, value in reference[0]["params"].items():
        assert torch.equal(resumed[0]["params"][key], value), key


def test_with_a_global_batch_the_state_loads_on_another_number_of_workers(tmp_path):
    # no dropout: its masks are per rank, so another number of ranks draws other ones
    reference = run_ranks(train, 2, global_batch=12, dropout=0.0)        # 60 // 12 = 5 steps an epoch
    run_ranks(train, 2, str(tmp_path), stop_after=7, global_batch=12, dropout=0.0)
    resumed = run_ranks(train, 3, str(tmp_path), load=True, global_batch=12, dropout=0.0)
    assert resumed[0]["state"] == (7, 1, 2)
    # the samples of the steps after the save are the same at 3 workers: step s trains positions s*12..s*12+11
    assert sorted(i for r in resumed for b in r["seen"] for i in b) == \
        sorted(i for r in reference for b in r["seen"][7:] for i in b)
    for key, value in reference[0]["params"].items():
        got = resumed[0]["params"][key]
        assert ((got - value).abs().max() / value.abs().max()) <= 1e-5, key
    assert resumed[0]["lrs"] == reference[0]["lrs"][7:]


def refusal(directory, **kwargs):
    import ddtrain
    try:
        train(directory, load=True, **kwargs)
    except ddtrain.DDTrainError as exc:
        ddtrain.shutdown()
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_state_of_another_model_or_run_is_refused_naming_what_differs(tmp_path):
    run_ranks(train, 2, str(tmp_path), stop_after=3)
    got = run_ranks(refusal, 2, str(tmp_path), hidden=9)
    assert "was saved by another model or run" in got[0] and "'0.weight' is (8, 6) vs (9, 6)" in got[0], got[0]
    assert got[1] == got[0]      # one message, the same on every rank (the excepthook shows it once)
    got = run_ranks(refusal, 3, str(tmp_path))
    assert "world_size=2 vs 3" in got[0], got[0]                         # no global batch: only its own size


def test_a_damaged_state_is_named_and_the_one_before_it_loaded(tmp_path, capfd):
    from ddtrain.reliability import checkpoint
    run_ranks(train, 2, str(tmp_path), stop_after=3)
    run_ranks(train, 2, str(tmp_path), stop_after=5)
    newest = checkpoint.path_for(tmp_path, 5)
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0xFF
    newest.write_bytes(bytes(data))
    resumed = run_ranks(train, 2, str(tmp_path), load=True)
    assert resumed[0]["state"][0] == 3                                   # ckpt-00000003.pt loaded
    (older,) = [p for _, p in checkpoint.listing(tmp_path)]
    for _, path in checkpoint.listing(tmp_path):
        path.write_bytes(path.read_bytes()[:-7])                         # now every file is damaged
    got = run_ranks(refusal, 2, str(tmp_path))
    assert "every state file in" in got[0] and "ckpt-00000003.pt (truncated" in got[0], got[0]


def test_no_state_gives_none_and_a_train_checkpoint_is_not_a_scripts_state(tmp_path):
    from ddtrain.reliability import checkpoint
    assert run_ranks(train, 2, str(tmp_path / "empty"), load=True)[0]["state"] is None
    checkpoint.write(checkpoint.path_for(tmp_path / "train", 4), {"step": 4, "epoch": 1, "step_in_epoch": 4},
                     {"ranks": [], "shared": None})
    got = run_ranks(refusal, 2, str(tmp_path / "train"))
    assert "is a checkpoint of ddtrain train, not a script's state" in got[0], got[0]


@pytest.mark.parametrize("compression", ["topk:0.1", "powersgd:1:2"])
def test_compressor_state_is_saved_by_the_state_api(tmp_path, compression):
    options = {"compression": compression}
    reference = run_ranks(train, 2, strategy="ring", options=options, dropout=0.0)
    run_ranks(train, 2, str(tmp_path), stop_after=9, strategy="ring", options=options, dropout=0.0)
    resumed = run_ranks(train, 2, str(tmp_path), load=True, strategy="ring", options=options, dropout=0.0)
    for key, value in reference[0]["params"].items():
        assert torch.equal(resumed[0]["params"][key], value), key


class Augmented(Indexed):
    """A random transform drawn where the sample is loaded (in a loader worker, from that worker's stream)."""

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.rand(6), self.y[i], i


def with_workers(directory, *, stop_after=None, load=False):
    """One process, a loader with 2 workers and a random transform: (index, first input value) of every sample."""
    import ddtrain
    from ddtrain.training.state import Preempted
    ddtrain.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2)
    model, optimizer, loader = ddtrain.prepare(model, optimizer, loader, checkpoint_dir=False)
    state = ddtrain.load_state(directory) if load else None
    seen = []
    try:
        for _epoch in range(state.epoch if state else 0, 2):   # no set_epoch: each pass the next epoch
            for x, y, index in loader:
                seen += [(int(i), round(float(v), 6)) for i, v in zip(index, x[:, 0])]
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                if stop_after is not None and optimizer._ddtrain_counter.steps == stop_after:
                    ddtrain.save_state(directory)
                    raise Preempted(0)
    except Preempted:
        pass
    ddtrain.shutdown()
    return seen


def test_with_loader_workers_the_resumed_batches_keep_their_workers_random_transforms(tmp_path):
    # in this process (a world of one): the ranks of run_ranks are daemons, which may not start loader workers
    reference = with_workers(None)
    first = with_workers(str(tmp_path), stop_after=19)     # epoch 1 (15 steps each), 4 of its steps done
    then = with_workers(str(tmp_path), load=True)
    assert first + then == reference


def test_ddtrain_train_refuses_a_scripts_state_naming_it(tmp_path):
    from helpers import assert_one_clear_error, ddtrain
    run_ranks(train, 2, str(tmp_path), stop_after=3)
    result = ddtrain("train", "--model", "mlp", "--data", "digits", "--epochs", "1", "--quiet", "--checkpoint-dir",
                     str(tmp_path), "--resume")
    assert_one_clear_error(result, "is a script's state (ddtrain.save_state), not a checkpoint of ddtrain train")


def test_schedulers_and_a_scaler_given_to_prepare_and_periodic_saves(tmp_path):
    """prepare(model, optimizer, loader, scheduler, scaler): both returned as they are and saved; checkpoint_every=4
    saves after steps 4, 8, ... keeping the 2 newest, once the step's own code has run (the scheduler stepped)."""
    import ddtrain
    from ddtrain.reliability import checkpoint

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, total_iters=10)   # two of one class on one
        decay = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.5, total_iters=20)   # model: given to prepare
        scaler = torch.amp.GradScaler("cpu", init_scale=128.0, growth_interval=4)   # doubles every 4 steps
        loader = DataLoader(Indexed(), batch_size=4, shuffle=True)
        return ddtrain.prepare(model, optimizer, loader, warmup, decay, scaler, checkpoint_dir=str(tmp_path),
                               checkpoint_every=4)

    model, optimizer, loader, warmup, decay, scaler = build()
    assert isinstance(warmup, torch.optim.lr_scheduler.LinearLR) and isinstance(scaler, torch.amp.GradScaler)
    for x, y, _ in loader:                          # one epoch: 15 steps
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        warmup.step()
        decay.step()
    ddtrain.shutdown()
    assert [step for step, _ in checkpoint.listing(tmp_path)] == [12, 8]
    _, saved = checkpoint.read(checkpoint.path_for(tmp_path, 12))
    entry = saved["shared"]["entries"][0]
    assert [s["last_epoch"] for s in entry["schedulers"]] == [12, 12]   # saved after the schedulers' own step 12
    assert entry["scaler"]["scale"] == 128.0 * 2 ** 3 and entry["steps"] == 12
    model, optimizer, loader, warmup, decay, scaler = build()
    state = ddtrain.load_state()                   # the directory prepare() was given
    assert (state.step, state.epoch) == (12, 0)
    assert warmup.last_epoch == decay.last_epoch == 12 and scaler.get_scale() == 1024.0
    assert len(list(loader)) == 3                  # the 3 steps of the epoch not yet trained
    ddtrain.shutdown()


def test_two_schedulers_of_one_class_found_on_an_optimizer_are_refused_until_given_to_prepare(tmp_path):
    import ddtrain
    model = torch.nn.Linear(6, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, _ = ddtrain.prepare(model, optimizer, checkpoint_dir=False)
    torch.optim.lr_scheduler.StepLR(optimizer, 3)
    first = torch.optim.lr_scheduler.LinearLR(optimizer, 0.1)
    second = torch.optim.lr_scheduler.LinearLR(optimizer, 0.5)   # noqa: F841  (kept alive: found by the save)
    with pytest.raises(ddtrain.DDTrainError, match="2 of them LinearLR: pass them to prepare"):
        ddtrain.save_state(str(tmp_path))
    del first
    ddtrain.save_state(str(tmp_path))          # one LinearLR and one StepLR: each found as itself
    ddtrain.shutdown()


def test_checkpoint_info_reads_a_scripts_state(tmp_path):
    from helpers import ddtrain
    run_ranks(train, 2, str(tmp_path), stop_after=10, global_batch=12)
    shown = ddtrain("checkpoint", "info", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    for phrase in ("written by:    ddtrain.save_state (a script's state, 1 prepared model(s))",
                   "step:          10 optimizer steps (the loader's epoch 1 counted from 0, 5 of its steps done)",
                   "optimizers SGD, schedulers StepLR, 60 training samples, global batch 12", "2 workers",
                   "resumes on:    1, 2, 3, 4, 6, 12 workers", "integrity:     ok"):
        assert phrase in shown.stdout, (phrase, shown.stdout)
