"""Bytes a strategy records for one step match the cost model (acceptance 4).

One training step of an N-parameter model (N = 9,610 float32) on R = 4 ranks. The cost model
(``ddtrain.costmodel``) is read two ways: the byte term of the α-β time of each all-reduce
(the β coefficient: bytes on the critical path) and document 000's communication counts
(values per step). What each is compared with:

* ring: every rank sends (and receives) ``2(R-1)/R·N`` values = ``decentralized_count(N, R, 1)``
  = the β coefficient of ``ring_time``; ``2(R-1)`` messages per bucket;
* tree: the root sends and receives ``⌈log2 R⌉·N`` each way; together the β coefficient of
  ``tree_time``, ``2⌈log2 R⌉·N``;
* central: the root (000's master) sends and receives ``(R-1)·N`` each way; together
  ``centralized_count(N, R, 1)`` = the β coefficient of ``central_time``;
* ps-sync on 3 workers + 1 server: the server receives and sends ``W·N`` values, together
  ``centralized_count(N, W+1, 1)``, plus one named header per message: 16 bytes (int64 kind,
  int64 version), ``2W`` messages; each worker sends and receives ``N`` values + 16 bytes.

Within 1% plus exactly those headers (the all-reduces have none: payload bytes only).
"""
import math

import torch
import torch.nn as nn

from ddtrain import costmodel
from ddtrain.sync import SyncOptions, wrap
from ddtrain.sync.ps.protocol import header_bytes
from multirank import run_ranks

WORLD = 4
FLOAT = 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


N = sum(p.numel() for p in _model().parameters())
# ps-sync's header: kind, version, aux, the SGD hyper-parameters and a has-gradient flag per parameter (one server)
HEADER_BYTES = header_bytes(torch.optim.SGD(_model().parameters(), lr=0.1), len(list(_model().parameters())))


def one_step(strategy):
    """This rank's per-operation traffic for one step, and its role."""
    model = _model()
    synced = wrap(strategy, model, torch.optim.SGD(model.parameters(), lr=0.1), SyncOptions(check_every=0))
    if synced.role == "server":
        synced.serve()
    else:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
        synced.model(x).square().mean().backward()
        synced.optimizer.step()
        synced.after_step(0)
    synced.update_stats()
    stats = synced.stats.as_dict()
    synced.finish()
    return synced.role, stats


def beta_bytes(algorithm, nbytes, ranks):
    """The byte term of the α-β model: predicted time with α = γ = 0, β = 1 s/byte."""
    return costmodel.PREDICTORS[algorithm](nbytes, ranks, 0.0, 1.0, 0.0)


def close(measured, predicted, headers=0):
    return abs(measured - headers - predicted) <= 0.01 * predicted


def test_allreduce_strategies_move_what_the_cost_model_says():
    nbytes = N * FLOAT
    for algorithm in ("ring", "tree", "central"):
        results = run_ranks(one_step, WORLD, algorithm)
        for rank, (_role, stats) in enumerate(results):
            assert stats["method"] == "counted" and list(stats["by_operation"]) == [algorithm]
            sent, received = stats["bytes_sent"], stats["bytes_received"]
            if algorithm == "ring":
                predicted = beta_bytes("ring", nbytes, WORLD)
                assert predicted == float(costmodel.decentralized_count(N, WORLD, 1)) * FLOAT
                assert close(sent, predicted) and close(received, predicted), (rank, sent, received, predicted)
                assert stats["messages_sent"] % (2 * (WORLD - 1)) == 0   # 2(R-1) per bucket
            elif rank == 0:            # the root of tree and central
                predicted = beta_bytes(algorithm, nbytes, WORLD)
                assert close(sent + received, predicted), (algorithm, sent, received, predicted)
                assert sent == received
                levels = math.ceil(math.log2(WORLD))
                steps = 2 * levels if algorithm == "tree" else 2 * (WORLD - 1)
                assert stats["messages_sent"] + stats["messages_received"] == steps
                if algorithm == "central":
                    assert predicted == float(costmodel.centralized_count(N, WORLD, 1)) * FLOAT


def test_parameter_server_moves_what_the_cost_model_says_plus_named_headers():
    workers = WORLD - 1
    results = run_ranks(one_step, WORLD, "ps-sync")
    assert [role for role, _ in results] == ["worker"] * workers + ["server"]
    server = results[-1][1]["by_operation"]["ps-sync"]
    predicted = float(costmodel.centralized_count(N, workers + 1, 1)) * FLOAT
    headers = 2 * workers * HEADER_BYTES
    assert close(server["bytes_sent"] + server["bytes_received"], predicted, headers), (server, predicted)
    assert server["messages_sent"] == server["messages_received"] == workers
    for _, stats in results[:workers]:
        step = stats["by_operation"]["ps-sync"]
        assert step["bytes_sent"] == step["bytes_received"] == N * FLOAT + HEADER_BYTES
        assert step["messages_sent"] == step["messages_received"] == 1
