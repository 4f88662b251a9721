"""Parameter servers are drop-in for a training script (issue 15 point 5, and points 1-2 for ps-*).

A script prepared with ps-sync / ps-async on 3 Gloo ranks (2 workers + 1 server) sees 2 ranks
(``ddtrain.world_size()``; ``total_ranks()`` and ``is_server()`` tell the rest), reduces among
the workers through ``ddtrain.worker_group()``, and gets from ps-sync the parameters and the
optimizer state of a hand-written PyTorch loop at the global batch: a StepLR and a hand edit
of the lr after ``prepare`` (which the servers apply), accumulation through ``model.no_sync()``,
an unused head with weight decay (no gradient: unchanged), two models prepared one after the
other (GAN-style), and a checkpoint saved after some steps and loaded after a new ``prepare``.
Each property is recorded separately so that each test names the one that broke.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import assert_same_parameters
from multirank import run_ranks

B, STEPS, MORE = 4, 3, 2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(5, 6)
        self.head = torch.nn.Linear(6, 2)
        self.unused = torch.nn.Linear(6, 2)   # never in forward

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def problem():
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD([{"params": net.body.parameters(), "momentum": 0.9},
                                 {"params": [*net.head.parameters(), *net.unused.parameters()], "weight_decay": 0.1}],
                                lr=0.2)
    gan = torch.nn.Linear(3, 5), torch.nn.Linear(5, 1)
    gan_optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in gan]
    return net, optimizer, gan, gan_optimizers


def batch(step: int, rank: int, workers: int = 2):
    """Worker ``rank``'s samples of ``step`` (the global batch is every worker's, in rank order)."""
    g = torch.Generator().manual_seed(100 + step)
    x, y, z = torch.randn(workers * B, 5, generator=g), torch.randn(workers * B, 2, generator=g), \
        torch.randn(workers * B, 3, generator=g)
    part = slice(rank * B, (rank + 1) * B) if rank is not None else slice(None)
    return x[part], y[part], z[part]


def net_step(model, optimizer, step, rank, no_sync=None):
    """Two micro-batches (the first inside ``no_sync``), then one optimizer step."""
    x, y, _ = batch(step, rank)
    half = len(x) // 2
    for part, first in ((slice(None, half), True), (slice(half, None), False)):
        loss = F.mse_loss(model(x[part]), y[part]) / 2
        if first and no_sync is not None:
            with no_sync():
                loss.backward()
        else:
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def gan_step(g, d, g_opt, d_opt, step, rank):
    _, _, z = batch(step, rank)
    d_loss = d(g(z).detach()).square().mean()
    d_loss.backward()
    d_opt.step()
    d_opt.zero_grad()
    g_loss = (d(g(z)) - 1).square().mean()
    g_loss.backward()
    g_opt.step()
    g_opt.zero_grad()
    d_opt.zero_grad()


def hand_written() -> dict:
    """The reference: one process, the global batch, no ddtrain."""
    net, optimizer, (g, d), (g_opt, d_opt) = problem()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(STEPS):
        net_step(net, optimizer, step, None)
        gan_step(g, d, g_opt, d_opt, step, None)
        scheduler.step()
    after = {k: v.clone() for k, v in net.state_dict().items()}
    state = copy.deepcopy(optimizer.state_dict())        # state_dict() holds the live buffers
    optimizer.param_groups[0]["lr"] = 0.05                 # a hand edit, after the checkpoint
    for step in range(STEPS, STEPS + MORE):
        net_step(net, optimizer, step, None)
    return {"after": after, "state": state, "resumed": net.state_dict(),
            "g": g.state_dict(), "d": d.state_dict()}


def attempt(record: dict, key: str, fn):
    try:
        record[key] = fn()
    except Exception as exc:   # recorded: each test asserts its own property
        record[key] = f"error: {type(exc).__name__}: {exc}"


def script(strategy: str, path: str, gan: bool) -> dict:
    """On every rank: train (with ``gan``: two more models prepared after the first), save a checkpoint on worker 0."""
    import ddtrain
    net, optimizer, (g, d), (g_opt, d_opt) = problem()
    try:
        net, optimizer, _ = ddtrain.prepare(net, optimizer, strategy=strategy)
    except SystemExit:
        return {"role": "server"}
    out = {"role": "worker"}
    attempt(out, "counts", lambda: (ddtrain.world_size(), ddtrain.rank(), ddtrain.total_ranks(), ddtrain.is_server()))
    rank = dist.get_rank()
    out["gan_prepared"] = False
    if gan:
        (g, g_opt), (d, d_opt) = [ddtrain.prepare(m, o, strategy=strategy)[:2] for m, o in ((g, g_opt), (d, d_opt))]
        out["gan_prepared"] = True
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(STEPS):
        net_step(net, optimizer, step, rank, no_sync=getattr(net, "no_sync", None))
        if out["gan_prepared"] is True:
            gan_step(g, d, g_opt, d_opt, step, rank)
        scheduler.step()
    out["after"] = {k: v.detach().clone() for k, v in net.state_dict().items()}
    if out["gan_prepared"] is True:
        out["g"], out["d"] = g.state_dict(), d.state_dict()
    attempt(out, "state", optimizer.state_dict)
    if rank == 0:
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, path)
    total = torch.tensor([float(rank + 1)])
    attempt(out, "worker_sum", lambda: (dist.all_reduce(total, group=ddtrain.worker_group()), total.item())[1])
    dist.barrier(group=ddtrain.worker_group())
    ddtrain.shutdown()
    return out


def resume(strategy: str, path: str) -> dict:
    """A new job: prepare fresh objects, load the checkpoint, lower the lr by hand, train on."""
    import ddtrain
    net, optimizer, _, _ = problem()
    try:
        net, optimizer, _ = ddtrain.prepare(net, optimizer, strategy=strategy)
    except SystemExit:
        return {"role": "server"}
    out, rank = {"role": "worker"}, dist.get_rank()
    checkpoint = torch.load(path, weights_only=True)
    net.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    optimizer.param_groups[0]["lr"] = 0.05
    for step in range(STEPS, STEPS + MORE):
        net_step(net, optimizer, step, rank)
    out["resumed"] = {k: v.detach().clone() for k, v in net.state_dict().items()}
    ddtrain.shutdown()
    return out


@pytest.fixture(scope="module")
def ps_sync(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ps") / "checkpoint.pt")
    results = run_ranks(script, 3, "ps-sync", path, False, timeout_s=120)
    for out, resumed in zip(results, run_ranks(resume, 3, "ps-sync", path, timeout_s=120)):
        out.update(resumed)
    return results, hand_written()


def workers_of(results):
    assert results[2]["role"] == "server"
    return results[:2]


def test_world_size_and_rank_count_workers(ps_sync):
    results, _ = ps_sync
    for rank, out in enumerate(workers_of(results)):
        assert out["counts"] == (2, rank, 3, False)     # world_size, rank, total_ranks, is_server


def test_a_collective_among_workers_through_worker_group(ps_sync):
    for out in workers_of(ps_sync[0]):
        assert out["worker_sum"] == 1.0 + 2.0           # what dist.all_reduce of (rank + 1) over the 2 workers gives


def test_scheduler_no_sync_and_unused_head_equal_a_hand_written_loop(ps_sync):
    results, reference = ps_sync
    for out in workers_of(results):
        assert_same_parameters(reference["after"], out["after"])
        torch.testing.assert_close(out["after"]["unused.weight"], reference["after"]["unused.weight"], rtol=0, atol=0)


def test_optimizer_state_dict_is_the_servers_real_state(ps_sync):
    results, reference = ps_sync
    for out in workers_of(results):
        assert isinstance(out["state"], dict), out["state"]
        want, got = reference["state"]["state"], out["state"]["state"]
        assert sorted(got) == sorted(want)                # momentum buffers of the body (group 0) only
        for index in want:
            torch.testing.assert_close(got[index]["momentum_buffer"], want[index]["momentum_buffer"])


def test_checkpoint_loaded_after_prepare_resumes_the_run(ps_sync):
    results, reference = ps_sync
    for out in workers_of(results):
        assert_same_parameters(reference["resumed"], out["resumed"])


def test_two_models_prepared_gan_style(ps_sync, tmp_path):
    """Two more models prepared after the first: no deadlock, and ps-sync's steps of each are the reference's."""
    _, reference = ps_sync
    results = run_ranks(script, 3, "ps-sync", str(tmp_path / "checkpoint.pt"), True, timeout_s=120)
    for out in workers_of(results):
        assert out["gan_prepared"] is True, out["gan_prepared"]
        assert_same_parameters(reference["g"], out["g"])
        assert_same_parameters(reference["d"], out["d"])


def async_script(path: str) -> dict:
    """ps-async: the same counts and collectives, two models, and an lr set to 0 after prepare freezes training."""
    import ddtrain
    net, optimizer, (g, d), (g_opt, d_opt) = problem()
    start = {k: v.clone() for k, v in net.state_dict().items()}
    try:
        net, optimizer, _ = ddtrain.prepare(net, optimizer, strategy="ps-async")
        (g, g_opt), (d, d_opt) = [ddtrain.prepare(m, o, strategy="ps-async")[:2] for m, o in ((g, g_opt), (d, d_opt))]
    except SystemExit:
        return {"role": "server"}
    out = {"role": "worker", "counts": (ddtrain.world_size(), ddtrain.total_ranks())}
    rank = dist.get_rank()
    d_start = {k: v.clone() for k, v in d.state_dict().items()}
    for group in optimizer.param_groups:
        group["lr"] = 0.0                                  # the servers must apply this, not their own 0.2
    for step in range(STEPS):
        net_step(net, optimizer, step, rank, no_sync=net.no_sync)
        gan_step(g, d, g_opt, d_opt, step, rank)
    out["frozen"] = all(torch.equal(v, start[k]) for k, v in net.state_dict().items())
    out["d_moved"] = any(not torch.equal(v, d_start[k]) for k, v in d.state_dict().items())
    out["metric"] = ddtrain.all_reduce_metric(float(rank + 1))     # among the workers: no server in it
    out["metric_mean"] = ddtrain.all_reduce_metric(float(rank + 1), "mean")    # (1 + 2) / 2 workers, not / 3 ranks
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, group=ddtrain.worker_group())
    out["worker_sum"] = total.item()
    ddtrain.shutdown()
    return out


def test_ps_async_counts_workers_follows_the_workers_lr_and_serves_two_models():
    results = run_ranks(async_script, 3, "", timeout_s=120)
    assert results[2]["role"] == "server"
    for out in results[:2]:
        assert out["counts"] == (2, 3)
        assert out["frozen"], "the server applied its own learning rate instead of the workers' 0"
        assert out["d_moved"]
        assert out["worker_sum"] == out["metric"] == 3.0
        assert out["metric_mean"] == 1.5


CLIP = 0.05    # below the gradients' norm on every step here: the clip is active


def clip_before_step(optimizer):
    def clip(opt, _args, _kwargs):
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"] if p.grad is not None], CLIP)
    return optimizer.register_step_pre_hook(clip)


def clipped(_unused: str) -> dict:
    """ps-sync with the clip as a step pre-hook registered before prepare: the servers clip the workers' mean."""
    import ddtrain
    net, optimizer, _, _ = problem()
    clip_before_step(optimizer)
    try:
        net, optimizer, _ = ddtrain.prepare(net, optimizer, strategy="ps-sync")
    except SystemExit:
        return {"role": "server"}
    for step in range(STEPS):
        net_step(net, optimizer, step, dist.get_rank())
    out = {"role": "worker", "params": {k: v.detach().clone() for k, v in net.state_dict().items()}}
    ddtrain.shutdown()
    return out


def test_a_clip_registered_as_a_step_pre_hook_clips_the_global_gradient_on_the_servers():
    net, optimizer, _, _ = problem()
    norms = []
    for step in range(STEPS):
        x, y, _ = batch(step, None)
        F.mse_loss(net(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    assert min(norms) > CLIP
    for out in workers_of(run_ranks(clipped, 3, "", timeout_s=120)):
        assert_same_parameters(net.state_dict(), out["params"])
