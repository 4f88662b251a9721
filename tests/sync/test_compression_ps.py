"""--compression fp16/bf16 with parameter servers: gradients travel in 16 bits, parameters and SET in full precision.

2 workers + 1 server (ps-sync), plain SGD: every update must equal the reference written here,
params - lr · mean over workers of (each worker's float32 gradient rounded to the 16-bit type);
a worker's gradient message carries N·2 payload bytes instead of N·4 (the header is the same);
parameters changed on a worker after prepare reach the server bit for bit (SET in full
precision). PowerSGD and top-k are refused with one message.
"""
import pytest
import torch
import torch.nn as nn

from ddtrain.errors import DDTrainError
from ddtrain.sync import SyncOptions, wrap
from multirank import run_ranks

STEPS = 3
LR = 0.1


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


N = sum(p.numel() for p in _model().parameters())


def ps_run(strategy: str, method: str):
    model = _model()
    synced = wrap(strategy, model, torch.optim.SGD(model.parameters(), lr=LR), SyncOptions(compression=method))
    if synced.role == "server":
        synced.serve()
        return None
    g = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
    history = []
    for step in range(STEPS):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        synced.optimizer.zero_grad()
        nn.functional.cross_entropy(synced.model(x), y).backward()
        history.append(([p.detach().clone() for p in model.parameters()], [p.grad.clone() for p in model.parameters()]))
        synced.optimizer.step()
        synced.after_step(step)
    after = [p.detach().clone() for p in model.parameters()]
    synced.update_stats()
    sent = synced.stats.as_dict()["by_operation"][strategy]["bytes_sent"]
    with torch.no_grad():   # a change made outside training (as a loaded checkpoint): goes to the server as SET
        for p in model.parameters():
            p.add_(1e-7)
    edited = [p.detach().clone() for p in model.parameters()]
    synced.optimizer.zero_grad(set_to_none=False)
    synced.optimizer.step()          # zero gradients: the server sends back exactly what it was given
    synced.after_step(STEPS)
    returned = [p.detach().clone() for p in model.parameters()]
    synced.finish()
    return history, after, sent, edited, returned


def two_runs():
    return {method: ps_run("ps-sync", method) for method in ("none", "fp16", "bf16")}


def test_ps_sync_applies_the_mean_of_16_bit_gradients_and_sends_half_the_payload():
    ranks = run_ranks(two_runs, 3)
    workers = ranks[:2]
    for method, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for step in range(STEPS):
            before = workers[0][method][0][step][0]
            grads = [w[method][0][step][1] for w in workers]
            after = workers[0][method][0][step + 1][0] if step + 1 < STEPS else workers[0][method][1]
            for i, p in enumerate(before):
                mean = (grads[0][i].to(dtype).float() + grads[1][i].to(dtype).float()) / 2
                torch.testing.assert_close(after[i], p - LR * mean, rtol=0, atol=1e-7)
        for w in workers:
            # same header, half the gradient payload, every step
            assert w["none"][2] - w[method][2] == STEPS * N * 2
            for edited, returned in zip(w[method][3], w[method][4]):
                assert torch.equal(edited, returned), "SET went through the 16-bit payload"


def refused_on_rank(method):
    model = _model()
    try:
        wrap("ps-sync", model, torch.optim.SGD(model.parameters(), lr=LR), SyncOptions(compression=method))
    except DDTrainError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("method", ["powersgd:2", "topk:0.1"])
def test_powersgd_and_topk_are_refused_by_parameter_servers(method):
    for message in run_ranks(refused_on_rank, 3, method):
        assert message is not None and f"compression {method} is not supported with parameter servers" in message
