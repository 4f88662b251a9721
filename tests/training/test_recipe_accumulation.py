"""Gradient accumulation: R workers x K micro-batches of B take the steps of a plain PyTorch loop with batch R*K*B.

For every synchronous strategy in ``STRATEGIES`` (ddp, ring, ring-async, tree, butterfly, central,
ps-sync, hybrid), on 3 Gloo ranks (ps-sync: 2 workers and a server), against a loop written here
(``torch.optim.SGD`` over one seeded permutation per epoch, cut into batches of R*K*B); then the
whole recipe (AdamW without decay on biases, warm-up then cosine, clipping, label smoothing)
against the same loop with torch's AdamW, ``clip_grad_norm_`` and the schedule's closed form;
and the communication: K micro-batches per update send the bytes of one batch per update.
A short last micro-batch (96 samples in micro-batches of 10: the 10th has 6) weighs by its
samples, so the update over it is the plain loop's update over that batch of 46.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import N_SAMPLES, assert_same_parameters, tiny_data, tiny_model
from multirank import run_ranks

from ddtrain import TrainConfig, fit
from ddtrain.sync import STRATEGIES

WORLD, B, K, EPOCHS, SEED, LR = 3, 4, 2, 2, 3, 0.1
SYNCHRONOUS = [name for name, spec in STRATEGIES.items() if spec.synchronous]
RECIPE = dict(optimizer="adamw", weight_decay=0.05, lr_schedule="cosine", lr_warmup_steps=2, clip_grad=0.5,
              label_smoothing=0.1, lr=0.01)


def train(strategy, batch_size, grad_accum, epochs=EPOCHS, steps=0, **extra):
    model, shape = tiny_model("mlp")
    config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy=strategy, epochs=epochs, steps=steps,
                                   batch_size=batch_size, grad_accum=grad_accum, seed=SEED, val_fraction=0.0,
                                   quiet=True, **{"lr": LR, "momentum": 0.9, **extra})
    record = fit(model, tiny_data(shape), config)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"role": record["role"], "workers": record["workers"], "params": params, "comm": record["comm"],
            "steps": sum(e["steps"] for e in record["epochs"]), "global_batch": record["global_batch_size"]}


def cases(items):
    """Every case in one process group (run on each rank)."""
    return [train(*args, **kwargs) for args, kwargs in items]


def plain_loop(global_batch, recipe=False):
    """The reference: one process, batch ``global_batch``; with ``recipe`` the RECIPE's optimizer, schedule, clip, loss."""
    model, shape = tiny_model("mlp")
    train_set = tiny_data(shape).train
    steps_per_epoch = N_SAMPLES // global_batch
    if recipe:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": RECIPE["weight_decay"]},
                                       {"params": rest, "weight_decay": 0.0}], lr=RECIPE["lr"])
        total, warm = EPOCHS * steps_per_epoch, RECIPE["lr_warmup_steps"]
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    update = 0
    for epoch in range(1, EPOCHS + 1):
        order = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
        for s in range(steps_per_epoch):
            idx = order[s * global_batch:(s + 1) * global_batch]
            optimizer.zero_grad()
            if recipe:
                lr = RECIPE["lr"] * ((update + 1) / warm if update < warm else
                                     0.5 * (1 + math.cos(math.pi * (update - warm) / (total - warm))))
                for group in optimizer.param_groups:
                    group["lr"] = lr
                F.cross_entropy(model(train_set.x[idx]), train_set.y[idx],
                                label_smoothing=RECIPE["label_smoothing"]).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["clip_grad"])
            else:
                F.cross_entropy(model(train_set.x[idx]), train_set.y[idx]).backward()
            optimizer.step()
            update += 1
    return model.state_dict()


def workers_of(strategy):
    return WORLD - STRATEGIES[strategy].extra_ranks(1)


def test_k_micro_batches_equal_one_batch_k_times_larger_for_every_synchronous_strategy():
    items = [((s, B, K), {}) for s in SYNCHRONOUS]
    items += [(("ddp", B, K), RECIPE), (("ps-sync", B, K), RECIPE)]
    per_rank = run_ranks(cases, WORLD, items, timeout_s=300)
    references = {}
    for i, ((strategy, batch, k), extra) in enumerate(items):
        global_batch = workers_of(strategy) * k * batch
        key = (global_batch, bool(extra))
        if key not in references:
            references[key] = plain_loop(global_batch, recipe=bool(extra))
        workers = [r[i] for r in per_rank if r[i]["role"] == "worker"]
        assert len(workers) == workers_of(strategy), strategy
        for got in workers:
            assert got["global_batch"] == global_batch
            assert got["steps"] == EPOCHS * N_SAMPLES // global_batch, strategy
            assert_same_parameters(references[key], got["params"], rtol=1e-5)


def test_accumulated_micro_batches_communicate_once_per_update():
    """With K=2 every synchronous strategy sends what K=1 sends for the same number of updates (ring also K=4);
    fsdp, which gathers the parameters for each micro-batch's forward and backward, sends more."""
    once = {"steps": 4, "epochs": 0}
    items = [((s, B, k), once) for s in SYNCHRONOUS for k in (1, 2)] + [(("ring", B, 4), {"steps": 2, "epochs": 0})]
    per_rank = run_ranks(cases, WORLD, items, timeout_s=300)
    for rank, results in enumerate(per_rank):
        sent = {(strategy, k): r["comm"][rank]["bytes_sent"] for ((strategy, _, k), _), r in zip(items, results)}
        for strategy in SYNCHRONOUS:
            assert sent[strategy, 1] > 0, strategy
            if "parameters" in STRATEGIES[strategy].shards:   # fsdp gathers the parameters for every micro-batch
                assert sent[strategy, 2] > sent[strategy, 1], (strategy, rank, sent[strategy, 1], sent[strategy, 2])
                continue
            assert sent[strategy, 2] == sent[strategy, 1], (strategy, rank, sent[strategy, 1], sent[strategy, 2])
        assert sent["ring", 4] * 2 == sent["ring", 1]


def test_a_short_last_micro_batch_weighs_by_its_samples_not_as_a_full_one():
    """One process, micro-batches of 10, K=5: an epoch's updates are over samples 0-49 and 50-95 of its permutation
    (the last micro-batch has 6 samples), exactly the plain loop's two batches of 50 and 46."""
    got = train("ddp", 10, 5, epochs=2)
    assert got["steps"] == 4 and got["workers"] == 1
    model, shape = tiny_model("mlp")
    train_set = tiny_data(shape).train
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for epoch in (1, 2):
        order = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
        for idx in (order[:50], order[50:]):
            optimizer.zero_grad()
            F.cross_entropy(model(train_set.x[idx]), train_set.y[idx]).backward()
            optimizer.step()
    assert_same_parameters(model.state_dict(), got["params"], rtol=1e-5)


def lr_at_start(strategy: str) -> tuple:
    """(role, the lr fit's optimizer starts at, the record's global batch) with --scale-lr linear and reference B."""
    model, shape = tiny_model("mlp")
    config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy=strategy, steps=1, batch_size=B, seed=SEED,
                                   val_fraction=0.0, quiet=True, lr=LR, scale_lr="linear", lr_reference_batch=B)
    seen = {}

    class Look:
        def on_train_begin(self, state):
            seen["lr"] = state.optimizer.param_groups[0]["lr"]

    record = fit(model, tiny_data(shape), config, callbacks=[Look()])
    return record["role"], seen["lr"], record["global_batch_size"]


def test_scale_lr_counts_the_workers_not_the_parameter_servers():
    """--scale-lr linear with the reference batch B: lr x (workers x B / B). On 3 ranks ddp has 3 workers; ps-sync has 2
    workers and a server, whose optimizer steps with the workers' lr: x2 on every rank, not x3."""
    per_rank = run_ranks(cases_lr, WORLD, ["ddp", "ps-sync"])
    ddp, ps = [r[0] for r in per_rank], [r[1] for r in per_rank]
    assert all(lr == pytest.approx(LR * 3) and batch == 3 * B for _, lr, batch in ddp)
    assert [role for role, _, _ in ps] == ["worker", "worker", "server"]
    for role, lr, _ in ps:
        assert lr == pytest.approx(LR * 2), role
    assert ps[0][2] == 2 * B


def cases_lr(strategies):
    return [lr_at_start(s) for s in strategies]
