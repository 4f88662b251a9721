"""A script's own evaluation and collectives under parameter servers (issue 29, items 1 and 2).

On 3 Gloo ranks (2 workers, 1 server): workers that evaluate together every few steps under
ps-async, one of them slower, always finish (before: the fast worker waited in the metrics'
collective while the server held the slow one's gradient for the fast one's, a deadlock in 3 of
5 runs); a ``dist.barrier()`` on the default group, which holds the server, is refused at once
with the one-line fix (before: every ps run hung until the timeout, blaming "worker rank 0");
and a server whose worker goes silent says what that worker did last.
"""
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from multirank import RankError, run_ranks

TIMEOUT_S = 4.0       # the servers' deadline in these runs: a deadlock fails in seconds, not minutes
SILENT_TIMEOUT_S = 2.0


def evaluate_every(eval_every: int, staleness: int, seed: int) -> dict:
    """HF-style: evaluate every ``eval_every`` steps mid-epoch (gather + all-reduce among workers); worker 1 is slower."""
    import ddtrain
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(96, 4, generator=g), torch.randint(0, 2, (96,), generator=g))
    train, evaluation = DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=10)
    try:
        model, optimizer, train, evaluation = ddtrain.prepare(model, optimizer, train, evaluation, strategy="ps-async",
                                                              staleness=staleness, timeout_s=TIMEOUT_S, seed=seed)
    except SystemExit:
        return {"role": "server"}
    accuracies = []
    for step, (x, y) in enumerate(train):
        if ddtrain.rank() == 1:
            time.sleep(0.01)                     # the slow worker: the other runs ahead as far as the bound lets it
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % eval_every == 0:
            model.eval()
            correct = 0
            with torch.no_grad():
                for xe, ye in evaluation:
                    predictions = ddtrain.gather_for_metrics(model(xe).argmax(1))
                    correct += int((predictions == ddtrain.gather_for_metrics(ye)).sum())
            accuracies.append(ddtrain.all_reduce_metric(correct) / 2)
            model.train()
    ddtrain.shutdown()
    return {"role": "worker", "evaluations": len(accuracies)}


def _runs_finish(runs: int) -> int:
    finished = 0
    for seed in range(runs):
        results = run_ranks(evaluate_every, 3, 4, 1, seed, timeout_s=60)   # staleness 1: the old code hung 5 runs of 5
        assert results[2] == {"role": "server"}
        assert [r["evaluations"] for r in results[:2]] == [3, 3]       # 12 steps each (48 samples), every 4th
        finished += 1
    return finished


def test_ps_async_workers_evaluating_together_mid_epoch_finish():
    # before: RankError within the 4 s deadline in most runs ("worker rank 0 failed or stopped answering")
    assert _runs_finish(3) == 3


@pytest.mark.slow
def test_ps_async_evaluation_every_n_steps_finishes_20_runs_of_20(capsys):
    start = time.monotonic()
    finished = _runs_finish(20)
    with capsys.disabled():
        print(f"\nps-async, evaluation every 4 steps, staleness 1: {finished} of 20 runs finished "
              f"in {time.monotonic() - start:.1f} s")
    assert finished == 20


def barrier_on_the_default_group(strategy: str, call: str) -> dict:
    import ddtrain
    model = torch.nn.Linear(2, 2)
    try:
        model, optimizer, _ = ddtrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy,
                                              timeout_s=TIMEOUT_S)
    except SystemExit:
        return {"role": "server"}
    dist.barrier(group=ddtrain.worker_group())             # the fix itself works
    start = time.monotonic()
    try:
        if call == "barrier":
            dist.barrier()
        elif call == "all_reduce":
            dist.all_reduce(torch.ones(1))
        else:
            dist.new_group([0, 1])
    except ddtrain.DDTrainError as exc:
        message, waited = str(exc), time.monotonic() - start
    else:
        message, waited = "no error", time.monotonic() - start
    ddtrain.shutdown()
    return {"role": "worker", "message": message, "waited_s": waited, "barrier_back": dist.barrier is _original()}


def _original():
    from torch.distributed import distributed_c10d
    return distributed_c10d.barrier


@pytest.mark.parametrize("strategy,call", [("ps-sync", "barrier"), ("ps-async", "all_reduce"), ("ps-sync", "new_group")])
def test_a_default_group_collective_in_the_script_is_refused_at_once_with_the_fix(strategy, call):
    # before: the barrier waited for the server until the process group's timeout (60 s here, 300 s by default)
    start = time.monotonic()
    results = run_ranks(barrier_on_the_default_group, 3, strategy, call, timeout_s=120)
    assert time.monotonic() - start < 30
    for rank, out in enumerate(results[:2]):
        assert out["waited_s"] < 1.0, out
        assert f"worker rank {rank} called torch.distributed.{call}()" in out["message"], out
        if call == "new_group":
            assert "before ddtrain.prepare(), or use ddtrain.worker_group()" in out["message"]
        else:
            assert "parameter-server rank(s) 2" in out["message"] and "group=ddtrain.worker_group()" in out["message"]
        assert out["barrier_back"], "torch.distributed's own functions are put back at shutdown"


def silent_after_pause() -> dict:
    """ps-async: worker 0 pauses for evaluation and then stays silent longer than the servers' deadline."""
    import ddtrain
    model = torch.nn.Linear(2, 2)
    try:
        model, optimizer, _ = ddtrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="ps-async",
                                              timeout_s=SILENT_TIMEOUT_S)
    except SystemExit:
        return {"role": "server"}
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    if ddtrain.rank() == 0:
        model.eval()
        with torch.no_grad():
            model(torch.ones(1, 2))                 # PAUSE "for evaluation"
        time.sleep(SILENT_TIMEOUT_S + 2)
    ddtrain.shutdown()
    return {"role": "worker"}


def test_a_server_names_what_a_silent_worker_did_last():
    # before: "worker rank 0 failed or stopped answering", nothing about what it was doing
    with pytest.raises(RankError) as caught:
        run_ranks(silent_after_pause, 3, timeout_s=120)
    server = caught.value.errors[2].splitlines()[0]
    assert "worker rank 0 failed or stopped answering" in server, server
    assert "was a pause for evaluation" in server, server
