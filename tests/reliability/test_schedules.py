"""The reliability components own their schedule: the same due steps on every rank, from the step alone."""
from types import SimpleNamespace

from ddtrain.reliability.checkpoint import Checkpointer
from ddtrain.reliability.config import ReliabilityConfig
from ddtrain.reliability.replicas import ReplicaCheck

STRATEGY = SimpleNamespace(module=None, group=None)


def checkpointer(every, max_steps=0, epochs=2):
    options = ReliabilityConfig(checkpoint_dir="unused", checkpoint_every=every)
    return Checkpointer(options, strategy=STRATEGY, strategy_name="ddp", optimizer=None, scaler=None, fingerprint={},
                        record={}, info={}, max_steps=max_steps, epochs=epochs)


def test_a_checkpoint_is_due_every_n_steps_at_epoch_ends_without_n_and_at_the_last_step():
    every_8 = checkpointer(8, max_steps=30)
    assert [s for s in range(1, 31) if every_8.due(s, end_of_epoch=False)] == [8, 16, 24, 30]
    per_epoch = checkpointer(0)
    assert not per_epoch.due(5, end_of_epoch=False) and per_epoch.due(23, end_of_epoch=True)


def test_a_replica_check_is_due_every_n_steps_or_at_epoch_ends():
    every_2 = ReplicaCheck(STRATEGY, check_every=2, on_mismatch="stop", info={})
    assert [s for s in range(1, 7) if every_2.due(s, end_of_epoch=s == 5)] == [2, 4, 6]
    per_epoch = ReplicaCheck(STRATEGY, check_every=0, on_mismatch="stop", info={})
    assert [s for s in range(1, 7) if per_epoch.due(s, end_of_epoch=s == 5)] == [5]
