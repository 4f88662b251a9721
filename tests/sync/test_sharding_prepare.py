"""zero1, zero2 and fsdp through ``ddtrain.prepare`` (the minimal-change path) against ddp, and their refusals.

3 Gloo ranks, a model of 124 elements (uneven shards), AdamW, two micro-batches per step (the
first inside ``no_sync()``), clipping as each strategy's script writes it, 40 updates, AdamW and SGD+momentum.
"""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ddtrain
from ddtrain.errors import ConfigError, DDTrainError
from multirank import run_ranks


def user_script(strategy, kind="adamw", epochs=10):
    """4 updates an epoch (96 samples, 3 ranks, micro-batches of 4, two per update): 40 updates."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01) if kind == "adamw" else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=kind == "sgd-fused")
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 7, generator=g), torch.randn(96, 3, generator=g))
    model, optimizer, loader = ddtrain.prepare(model, optimizer, DataLoader(data, batch_size=4), strategy=strategy)
    micro = []
    for x, y in (batch for _ in range(epochs) for batch in loader):
        micro.append((x, y))
        if len(micro) < 2:
            continue
        with model.no_sync():
            (torch.nn.functional.mse_loss(model(micro[0][0]), micro[0][1]) / 2).backward()
        (torch.nn.functional.mse_loss(model(micro[1][0]), micro[1][1]) / 2).backward()
        micro = []
        if strategy == "zero2":
            optimizer.clip_grad_norm_(0.5)    # ZeRO-2 keeps no .grad on the model: the optimizer clips the shards
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    full = optimizer.state_dict()
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.module.parameters()]
    params = [p.detach().clone() for p in params]
    ddtrain.shutdown()
    return params, {i: {k: v.shape for k, v in s.items() if torch.is_tensor(v)} for i, s in full["state"].items()}


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_prepare_equals_ddp(strategy, kind):
    """40 updates through prepare(), parameters within 1e-5 of the tensor's largest against ddp's."""
    ddp = run_ranks(user_script, 3, "ddp", kind)
    sharded = run_ranks(user_script, 3, strategy, kind)
    for a, b in zip(sharded[0][0], ddp[0][0]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item()), strategy
    assert sharded[0][1] == ddp[0][1]      # optimizer.state_dict(): the whole model's layout, as ddp's


def test_fsdp_takes_a_fused_optimizer():
    """A fused optimizer (ddtrain's recipe builds one on CUDA) steps DTensors with for-each kernels under fsdp.

    Pins the H200 failure of the first GPU run (results/sharding/gpu_h200_fused_sgd.log: "Operator
    aten._fused_sgd_.default does not have a sharding strategy registered"); torch's CPU fused SGD fails the same.
    """
    ddp = run_ranks(user_script, 3, "ddp", "sgd")
    sharded = run_ranks(user_script, 3, "fsdp", "sgd-fused")
    for a, b in zip(sharded[0][0], ddp[0][0]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def refused(what):
    """One rank: prepare something ZeRO or FSDP must refuse; returns the message."""
    model = torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.Linear(11, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    options = {}
    if what == "adafactor":
        optimizer = torch.optim.Adafactor(model.parameters())
    elif what == "mixed-dtypes":
        model[1].double()
        optimizer = torch.optim.AdamW(model.parameters())
    elif what == "fsdp-option":
        options = {"shard_algorithm": "ring"}
    elif what == "fsdp-scalar":
        model.temperature = torch.nn.Parameter(torch.tensor(1.0))   # 0-d: FSDP shards along dim 0
        optimizer = torch.optim.AdamW(model.parameters())
    try:
        ddtrain.prepare(model, optimizer, strategy="fsdp" if what.startswith("fsdp") else "zero2", **options)
    except (DDTrainError, ConfigError) as exc:
        return str(exc)
    finally:
        ddtrain.shutdown()
    return None


@pytest.mark.parametrize("what, says", [
    ("adafactor", "cannot split optimizer Adafactor: it keeps row and column statistics"),
    ("mixed-dtypes", "cannot share one flat buffer"),
    ("fsdp-option", "shard_algorithm is read only by zero1, zero2, not by strategy 'fsdp'"),
    ("fsdp-scalar", "fsdp: parameter 'temperature' is a scalar (0-d)")])
def test_refusals_one_message_each(what, says):
    messages = run_ranks(refused, 3, what)
    assert all(m is not None and says in m and "\n" not in m for m in messages), messages
