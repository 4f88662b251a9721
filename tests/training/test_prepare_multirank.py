"""``prepare`` on several Gloo ranks: which samples each rank sees, exact global metrics, GANs and branches.

Each test names the breakage of issue 15 it guards against; all failed on the code before it
(the user's sampler and IterableDatasets were not supported, no metric helpers,
``find_unused_parameters`` was refused, ``no_sync`` missing on local-sgd).
"""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from multirank import run_ranks

N = 22                                   # not divisible by 3 ranks: a remainder to drop or to spread
WEIGHTS = torch.linspace(0.1, 1.0, N)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(11))


def shards_and_metrics():
    """On each of 3 ranks: its training indices (two epochs), evaluation indices, iterable shares, metrics."""
    import ddtrain
    data = TensorDataset(torch.arange(N))
    model = torch.nn.Linear(1, 1)
    train = DataLoader(data, batch_size=3, sampler=WeightedRandomSampler(WEIGHTS, N))
    evaluation = evaluation_loader(data)
    model, _, train, evaluation = ddtrain.prepare(model, None, train, evaluation)
    epochs = []
    for epoch in range(2):
        train.sampler.set_epoch(epoch)          # as the torchrun tutorial does
        epochs.append([int(i) for (batch,) in train for i in batch])
    per_batch = [ddtrain.gather_for_metrics(batch) for (batch,) in evaluation]    # padding left out of the last
    seen = torch.cat([batch for (batch,) in evaluation])
    padded = {"count": ddtrain.all_reduce_metric(len(seen)), "total": float(ddtrain.all_reduce_metric(seen.double().sum()))}
    gathered = ddtrain.gather_for_metrics(seen)
    uneven = torch.cat([batch for (batch,) in ddtrain.prepare_loader(evaluation_loader(data), remainder="uneven")])
    exact = {"count": ddtrain.all_reduce_metric(len(uneven)), "total": float(ddtrain.all_reduce_metric(uneven.double().sum()))}
    stream_train = ddtrain.prepare_loader(DataLoader(Stream(), batch_size=2), training=True, remainder="drop")
    stream_eval = ddtrain.prepare_loader(DataLoader(Stream(), batch_size=2))
    ddtrain.shutdown()
    return {"epochs": epochs, "batches": len(train), "eval": seen.tolist(), "padded": padded, "exact": exact,
            "uneven": uneven.tolist(), "gathered": gathered.tolist(), "per_batch": torch.cat(per_batch).tolist(),
            "stream_train": [list(map(int, b)) for b in stream_train],
            "stream_eval": [int(i) for b in stream_eval for i in b]}


def evaluation_loader(data):
    return DataLoader(data, batch_size=4)


def test_the_users_sampler_is_sharded_and_metrics_are_exact_with_uneven_shards():
    # before: the WeightedRandomSampler was replaced by a uniform shuffle; no all_reduce_metric/gather_for_metrics;
    # IterableDataset failed with "has no len()". Issue 29: the remainder is padded as DistributedSampler pads it.
    results = run_ranks(shards_and_metrics, 3, timeout_s=180)
    for epoch in range(2):
        with torch.random.fork_rng():
            torch.manual_seed(0 + epoch)             # the seed every rank shares (prepare's seed + epoch)
            order = list(WeightedRandomSampler(WEIGHTS, N))
        padded = order + order[: 3 - N % 3]          # training: DistributedSampler's padding, equal steps
        for rank, result in enumerate(results):
            assert result["epochs"][epoch] == padded[rank::3], (epoch, rank)
    assert [r["batches"] for r in results] == [3, 3, 3]
    assert [len(r["eval"]) for r in results] == [8, 8, 8]          # evaluation: padded too, as DistributedSampler
    assert sorted(i for r in results for i in r["eval"]) == sorted([*range(N), 0, 1])
    assert [len(r["uneven"]) for r in results] == [8, 7, 7]        # remainder="uneven": every sample once
    assert sorted(i for r in results for i in r["uneven"]) == list(range(N))
    for result in results:
        assert result["padded"] == {"count": N + 2, "total": sum(range(N)) + 0 + 1}   # the twin's sums, repeats in
        assert result["exact"] == {"count": N, "total": sum(range(N))}
        assert result["gathered"] == list(range(N))                   # back in the loader's order, repeats left out
        assert result["per_batch"] == list(range(N))                  # also gathered batch by batch
    streamed = [i for r in results for batch in r["stream_train"] for i in batch]
    assert sorted(streamed) == list(range(9))                         # 3 whole groups of 3: no duplicates
    assert len({len(r["stream_train"]) for r in results}) == 1        # equal step counts on every rank
    assert sorted(i for r in results for i in r["stream_eval"]) == sorted([*range(11), 0])


class Discriminator(torch.nn.Module):
    """Two heads; the second is used on odd steps only (a branch unused on some steps)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.head_a = torch.nn.Linear(8, 1)
        self.head_b = torch.nn.Linear(8, 1)

    def forward(self, x, use_b: bool):
        h = torch.relu(self.body(x))
        return self.head_b(h) if use_b else self.head_a(h)


def gan(strategies):
    """On every rank, per strategy: a GAN (two prepares, two optimizers) with an intermittent branch."""
    import ddtrain
    out = {}
    for strategy in strategies:
        torch.manual_seed(0)
        generator, discriminator = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()), Discriminator()
        keys = (list(generator.state_dict()), list(discriminator.state_dict()))
        data = TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(1)))
        options = {"find_unused_parameters": True, **({"sync_every": 2} if strategy in ("local-sgd", "hybrid") else {})}
        generator, opt_g, loader = ddtrain.prepare(generator, torch.optim.Adam(generator.parameters(), lr=0.01),
                                                   DataLoader(data, batch_size=4, shuffle=True), strategy=strategy,
                                                   **options)
        discriminator, opt_d, _ = ddtrain.prepare(discriminator, torch.optim.SGD(discriminator.parameters(), lr=0.1),
                                                  strategy=strategy, **options)
        for step, (real,) in enumerate(loader):
            use_b = step % 2 == 1
            fake = generator(real)
            opt_d.zero_grad()
            with discriminator.no_sync():            # accumulate the real half, sync with the fake half
                F.softplus(-discriminator(real, use_b)).mean().backward()
            F.softplus(discriminator(fake.detach(), use_b)).mean().backward()
            opt_d.step()
            opt_g.zero_grad()
            F.softplus(-discriminator(fake, use_b)).mean().backward()
            opt_g.step()
        ddtrain.shutdown()                           # local-sgd: its last averaging
        out[strategy] = {"keys": (list(generator.state_dict()), list(discriminator.state_dict())) == keys,
                         "g": generator.state_dict(), "d": discriminator.state_dict()}
    return out


def test_gans_with_branches_unused_on_some_steps_train_on_every_strategy():
    # before: find_unused_parameters was a TypeError; no_sync() was missing on local-sgd; a second
    # prepare or a list of optimizers was not supported; keys gained "module." on some strategies
    strategies = ["ddp", "ring", "hybrid", "local-sgd"]
    ranks = run_ranks(gan, 2, strategies, timeout_s=180)
    for strategy in strategies:
        first, second = ranks[0][strategy], ranks[1][strategy]
        assert first["keys"] and second["keys"], strategy
        for part in ("g", "d"):
            for key, value in first[part].items():
                assert torch.equal(value, second[part][key]), (strategy, part, key)   # replicas agree
