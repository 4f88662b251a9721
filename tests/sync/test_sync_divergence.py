"""Replica divergence as the strategies record it (acceptance 2).

Dropout and a random input augmentation are on, with a different random stream on every rank
(``fit`` seeds each rank differently), and every rank sees different data, so replicas that
are not kept in step drift apart. local-sgd (K=20) must show that drift between averagings
and exactly zero right after each; hybrid must be zero right after each broadcast; the
synchronous strategies must stay within float noise (ours: bitwise identical).
"""
import torch
import torch.nn as nn

from ddtrain import TrainConfig, fit
from ddtrain.models import build_model
from ddtrain.sync import STRATEGIES
from ddtrain.sync.divergence import fingerprint, replica_divergence
from multirank import run_ranks
from helpers import tiny_data as _data

WORLD = 3              # ps-sync: 2 workers + 1 server
STEPS, CHECK_EVERY = 40, 5
CASES = [("local-sgd", 20), ("hybrid", 10), ("ddp", 1), ("ring", 1), ("tree", 1), ("ps-sync", 1),
         ("local-sgd", "epoch"), ("hybrid", "epoch")]


class NoiseAugment(nn.Module):
    """Gaussian input noise while training: per-rank randomness in the data itself."""

    def forward(self, x):
        return x + 0.3 * torch.randn_like(x) if self.training else x


def _model():
    torch.manual_seed(0)
    return nn.Sequential(NoiseAugment(), build_model("mlp", num_classes=10, in_channels=1, input_size=(8, 8),
                                                      hidden=(32, 16), dropout=0.5))


def divergence_records(cases):
    out = []
    for strategy, every in cases:
        model = _model()
        config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy=strategy, epochs=0, steps=STEPS, batch_size=8,
                             lr=0.1, seed=5, val_fraction=0.0, quiet=True, sync_every=every,
                             check_every=CHECK_EVERY)
        record = fit(model, _data((1, 8, 8)), config)
        scale = max(p.detach().abs().max().item() for p in model.parameters())
        out.append((record["comm"], scale))
    return out


def test_divergence_shows_drift_between_averagings_and_none_after_syncs():
    results = run_ranks(divergence_records, WORLD, CASES, timeout_s=300)
    for i, (strategy, every) in enumerate(CASES):
        comm, scale = results[0][i]
        checks = comm[0]["divergence"]            # rank 0's copy; every worker measured the same values
        assert all(c["divergence"] == w["divergence"] for worker in comm if worker["role"] == "worker"
                   for c, w in zip(checks, worker["divergence"]))
        assert set(range(CHECK_EVERY, STEPS + 1, CHECK_EVERY)) <= {c["step"] for c in checks}
        synced = [c for c in checks if c["after_sync"]]
        drifting = [c for c in checks if not c["after_sync"]]
        spec = STRATEGIES[strategy]
        if every == "epoch":        # synchronised at every epoch end (4 steps an epoch on 3 ranks), only there
            assert [c["step"] for c in synced] == list(range(4, STEPS + 1, 4)), checks
            assert all(c["divergence"] == 0.0 for c in synced), synced
            if not spec.synchronous:      # local-sgd: nothing keeps the replicas together between averagings
                assert drifting and all(c["divergence"] > 1e-4 * scale for c in drifting), drifting
        elif spec.periodic:         # local-sgd every 20 steps: [20, 40]; hybrid every 10: [10, 20, 30, 40]
            assert [c["step"] for c in synced] == list(range(every, STEPS + 1, every)), checks
            assert all(c["divergence"] == 0.0 for c in synced), synced
            if spec.synchronous:          # hybrid: the ring keeps them together between broadcasts too
                assert all(c["divergence"] <= 1e-6 * scale for c in checks), checks
            else:
                assert drifting and all(c["divergence"] > 1e-4 * scale for c in drifting), drifting
        else:
            assert not synced
            assert all(c["divergence"] <= 1e-6 * scale for c in checks), (strategy, checks)


def perturbed_divergence(rank_to_perturb, amount):
    """Rank ``rank_to_perturb`` adds ``amount`` to one element; everyone measures."""
    rank = torch.distributed.get_rank()
    tensors = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.ones(5, dtype=torch.float64)]
    same = replica_divergence(tensors)
    if rank == rank_to_perturb:
        tensors[0][1, 2] += amount
    return same, replica_divergence(tensors)


def test_replica_divergence_is_exact_and_cheap_when_replicas_agree():
    for same, changed in run_ranks(perturbed_divergence, WORLD, 2, 0.25):
        assert same == (0.0, False)              # hashes agree: no broadcast needed
        assert changed == (0.25, True)


def test_fingerprint_sees_swapped_values():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert not torch.equal(fingerprint([a]), fingerprint([a.flip(0)]))
    assert torch.equal(fingerprint([a]), fingerprint([a.clone()]))
