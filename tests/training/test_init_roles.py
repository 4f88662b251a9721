"""``ddtrain.init(strategy=...)``: a Horovod-style script reads ``world_size()`` before it builds its optimizer.

Horovod's MNIST example scales its learning rate by ``hvd.size()`` before wrapping the optimizer;
ported to ddtrain that is ``ddtrain.world_size()`` before ``prepare``. With parameter servers the
count must already be the workers' (2 of 3 ranks here), not every process of the job.
"""
from multirank import run_ranks


def roles_before_and_after_prepare(strategy):
    import torch

    import ddtrain
    from ddtrain.distributed import runtime
    ddtrain.init(strategy=strategy)
    before = (ddtrain.world_size(), ddtrain.rank(), runtime.total_ranks())
    if runtime.is_server():
        runtime.clear_roles()  # a server would serve inside prepare and leave; this test only asks who it is
        return before, None
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * ddtrain.world_size())
    runtime.clear_roles()
    return before, optimizer.param_groups[0]["lr"]


def test_world_size_counts_workers_from_init_on():
    results = run_ranks(roles_before_and_after_prepare, 3, "ps-sync")
    assert [r[0] for r in results] == [(2, 0, 3), (2, 1, 3), (2, 2, 3)]
    assert [round(r[1], 6) for r in results[:2]] == [0.2, 0.2]      # lr x workers, as with 2 DDP ranks
    results = run_ranks(roles_before_and_after_prepare, 3, "ddp")
    assert [r[0] for r in results] == [(3, 0, 3), (3, 1, 3), (3, 2, 3)]


def init_for_servers_then_prepare_without(strategy):
    import torch

    import ddtrain
    from ddtrain.errors import DDTrainError
    ddtrain.init(strategy="ps-sync")
    model = torch.nn.Linear(3, 2)
    try:
        ddtrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)
    except DDTrainError as exc:
        return str(exc), ddtrain.world_size()
    return None, ddtrain.world_size()


def test_init_and_prepare_naming_different_strategies_is_refused_on_every_rank():
    results = run_ranks(init_for_servers_then_prepare_without, 3, "ddp")
    assert all(r == ("prepare(strategy='ddp') but ddtrain.init(strategy=...) named 'ps-sync': world_size() counted "
                     "only workers until now; name the same strategy in both", 3) for r in results), results
