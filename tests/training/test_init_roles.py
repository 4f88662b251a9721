"""``ddtrain.init(strategy=...)``: a Horovod-style script reads ``world_size()`` before it builds its optimizer.

Horovod's MNIST example scales its learning rate by ``hvd.size()`` before wrapping the optimizer;
ported to ddtrain that is ``ddtrain.world_size()`` before ``prepare``. With parameter servers the
count must already be the workers' (2 of 3 ranks here), not every process of the job.
"""
from multirank import run_ranks


def roles_before_and_after_prepare(strategy):
    import torch

    import ddtrain
    from ddtrain.dist import runtime
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
