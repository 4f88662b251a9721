"""zero1 and zero2 against ddp and a plain PyTorch loop, on 3 Gloo ranks with shards of uneven length.

The model has 124 trainable elements (not a multiple of 3: shards of 42, 42 and 40) in two
optimizer param groups (weight decay on the matrices only), so group boundaries fall inside
shards. Each rank trains on its third of a global batch; the reference is one process stepping
the same optimizer on the whole batch (the gradient of the mean loss over it equals ddp's average).
"""
import pytest
import torch

from multirank import run_ranks

STEPS = 40
RTOL = 1e-5


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))


def make_optimizer(model, kind):
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.01)
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def batches(step, world=3, per_rank=4):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(world * per_rank, 7, generator=g), torch.randn(world * per_rank, 3, generator=g)


def reference(kind, clip=0.0, steps=STEPS):
    model = make_model()
    optimizer = make_optimizer(model, kind)
    for step in range(steps):
        x, y = batches(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def train_ranks(strategy, kind, clip=0.0, algorithm="native", steps=STEPS, per_layer=False):
    """One rank: ``strategy`` through ddtrain.sync.wrap (as fit applies it); returns (parameters, memory, state keys).

    ``per_layer``: the model's ``fsdp_units`` makes each Linear an FSDP unit (by default both are one).
    """
    import torch.distributed as dist

    from ddtrain import recipe
    from ddtrain.sync import SyncOptions, wrap
    rank = dist.get_rank()
    model = make_model()
    if per_layer:
        model.fsdp_units = (torch.nn.Linear,)
    optimizer = make_optimizer(model, kind)
    applied = wrap(strategy, model, optimizer, SyncOptions(shard_algorithm=algorithm) if strategy.startswith("zero")
                   else SyncOptions())
    hook = recipe.clip_gradients(applied.optimizer, clip) if clip else None
    for step in range(steps):
        x, y = batches(step)
        x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
        torch.nn.functional.mse_loss(applied.model(x), y).backward()
        applied.optimizer.step()
        applied.optimizer.zero_grad(set_to_none=True)
        applied.after_step(step)
    full = applied.optimizer.state_dict()     # collective under ZeRO
    memory = applied.memory.as_dict()         # what the run record's comm[i].memory holds (sync.memory)
    if hook is not None:
        hook.remove()
    applied.finish()
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in applied.module.parameters()]
    state_bytes = sum(v.to_local().numel() * v.element_size() if hasattr(v, "to_local") else v.numel() * v.element_size()
                      for s in applied.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return [p.detach().clone() for p in params], state_bytes, full, memory


def close(a, b, rtol=RTOL):
    return all(torch.allclose(x, y, rtol=rtol, atol=rtol * y.abs().max().item()) for x, y in zip(a, b))


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_zero_equals_ddp_and_plain_loop(strategy, kind):
    ddp = run_ranks(train_ranks, 3, "ddp", kind)
    zero = run_ranks(train_ranks, 3, strategy, kind)
    plain = reference(kind)
    for params, *_ in zero:
        assert all(torch.equal(a, b) for a, b in zip(params, zero[0][0]))   # replicas identical
    assert close(zero[0][0], ddp[0][0]) and close(zero[0][0], plain)
    # each rank keeps state for its shard only (42, 42, 40 of 124 elements): <= 0.4x ddp's
    assert max(r[1] for r in zero) <= 0.4 * ddp[0][1]
    # optimizer.state_dict() is the whole model's, as ddp's: same keys, shapes and values
    ddp_state, zero_state = ddp[0][2], zero[0][2]
    assert zero_state["state"].keys() == ddp_state["state"].keys()
    for i, s in ddp_state["state"].items():
        for key, value in s.items():
            if torch.is_tensor(value) and value.dim() > 0:
                assert zero_state["state"][i][key].shape == value.shape
                assert torch.allclose(zero_state["state"][i][key], value, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["ring", "butterfly"])
def test_zero2_over_ddtrain_algorithms_with_clipping(algorithm):
    zero = run_ranks(train_ranks, 3, "zero2", "adamw", 0.05, algorithm, 12)
    assert close(zero[0][0], reference("adamw", clip=0.05, steps=12))


@pytest.mark.parametrize("kind, per_layer", [("adamw", False), ("sgd", False), ("sgd", True)])
def test_fsdp_equals_ddp_and_plain_loop(kind, per_layer):
    """Both Linears one unit (fully_shard of a list, the default grouping), or one unit each (fsdp_units)."""
    ddp = run_ranks(train_ranks, 3, "ddp", kind)
    fsdp = run_ranks(train_ranks, 3, "fsdp", kind, 0.0, "native", STEPS, per_layer)
    assert close(fsdp[0][0], ddp[0][0]) and close(fsdp[0][0], reference(kind))
    assert max(r[1] for r in fsdp) <= 0.4 * ddp[0][1]
    assert fsdp[0][2]["state"][0]["exp_avg" if kind == "adamw" else "momentum_buffer"].shape == (11, 7)


@pytest.mark.parametrize("strategy, split", [("zero1", ("optimizer_state_bytes",)),
                                             ("zero2", ("gradient_bytes", "optimizer_state_bytes")),
                                             ("fsdp", ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"))])
def test_memory_meter_shows_the_split(strategy, split):
    """The record's per-rank bytes: what the strategy splits is <= 0.4x ddp's at 3 ranks, the rest is not smaller."""
    ddp = run_ranks(train_ranks, 3, "ddp", "adamw", 0.0, "native", 3)[0][3]
    for memory in (r[3] for r in run_ranks(train_ranks, 3, strategy, "adamw", 0.0, "native", 3)):
        for key in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
            if key in split:
                assert memory[key] <= 0.4 * ddp[key], (strategy, key, memory, ddp)
            else:
                assert memory[key] >= ddp[key], (strategy, key, memory, ddp)
