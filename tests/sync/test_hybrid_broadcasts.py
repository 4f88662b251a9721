"""hybrid's broadcasts, observed: replicas made to differ are unequal before each broadcast and equal right after.

hybrid's ring keeps the replicas identical on its own, so a broadcast that never happened would
leave no trace in the parameters. Here a callback pushes every rank but 0 off by a rank-dependent
amount at the start of every step; at the end of each step (after the strategy's sync) the
replicas must equal rank 0's exactly when a broadcast was due (every K steps, or at each epoch
end with ``sync_every="epoch"``) and differ otherwise. 3 ranks, so "equal" means all three.
"""
import torch
import torch.distributed as dist

from ddtrain import Callback, TrainConfig, fit
from helpers import tiny_data, tiny_model
from multirank import run_ranks

WORLD, BATCH, EPOCHS = 3, 8, 2        # 96 samples: 4 steps an epoch on 3 ranks


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def same_as_rank_0(module) -> list[bool]:
    """For each rank: are its parameters bitwise those of rank 0 (a collective, every rank gets the list)."""
    mine = flat(module)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [torch.equal(other, everyone[0]) for other in everyone]


class PushApart(Callback):
    """Moves rank r's parameters by r·1e-3 as each step starts; records whether the replicas agree."""

    def __init__(self):
        self.before, self.after, self.at_epoch_end = {}, {}, {}

    def on_step_begin(self, step, state):
        with torch.no_grad():
            for p in state.model.parameters():
                p.add_(1e-3 * dist.get_rank())
        self.before[step + 1] = all(same_as_rank_0(state.model))

    def on_step_end(self, step, logs, state):
        self.after[step] = all(same_as_rank_0(state.model))

    def on_epoch_end(self, epoch, logs, state):
        self.at_epoch_end[epoch] = all(same_as_rank_0(state.model))


def train_hybrid(sync_every):
    model, shape = tiny_model("mlp")
    config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy="hybrid", sync_every=sync_every,
                                   epochs=EPOCHS, batch_size=BATCH, lr=0.1, momentum=0.9, seed=3, val_fraction=0.0,
                                   quiet=True)
    log = PushApart()
    record = fit(model, tiny_data(shape), config, callbacks=[log])
    broadcasts = next(c for c in record["comm"] if c["rank"] == dist.get_rank())["broadcasts"]
    return log.before, log.after, log.at_epoch_end, broadcasts


def both_settings():
    return train_hybrid(3), train_hybrid("epoch")


def test_hybrid_replicas_are_equal_right_after_each_broadcast_and_unequal_before():
    for rank, (every_3, every_epoch) in enumerate(run_ranks(both_settings, WORLD)):
        before, after, at_epoch_end, broadcasts = every_3
        assert sorted(after) == list(range(1, 9)), rank
        assert not any(before.values()), rank                             # pushed apart as every step starts
        assert after == {s: s % 3 == 0 for s in range(1, 9)}, (rank, after)  # K=3: broadcasts after steps 3, 6
        assert broadcasts == 2
        # sync_every="epoch": unequal after every step, equal at each epoch end
        before, after, at_epoch_end, broadcasts = every_epoch
        assert not any(before.values()) and not any(after.values()), rank
        assert at_epoch_end == {1: True, 2: True}, rank
        assert broadcasts == EPOCHS
