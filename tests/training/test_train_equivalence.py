"""R ranks with per-rank batch B take the steps of a plain PyTorch loop with batch R*B (acceptance 3).

The reference is written here (``torch.optim.SGD`` over one seeded permutation per epoch, cut
into batches of R*B), not ddtrain's own single-process run, so that a bug shared by ddtrain's
single-process and distributed paths fails the test too.
"""
import pytest
import torch

from helpers import N_SAMPLES, assert_same_parameters, plain_sgd, tiny_data, tiny_model, train_and_return_parameters
from multirank import run_ranks

EPOCHS, SEED = 2, 3          # train_and_return_parameters' settings: lr 0.1, momentum 0.9, seed 3, 2 epochs


def plain_loop(name: str, global_batch: int) -> dict:
    model, shape = tiny_model(name)
    train = tiny_data(shape).train
    return plain_sgd(model, train.x, train.y, lr=0.1, momentum=0.9, epochs=EPOCHS, global_batch=global_batch,
                     epoch_order=lambda epoch: torch.randperm(
                         N_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch)))


@pytest.mark.parametrize("name", ["mlp", "simple-cnn"])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_batch_b_equal_a_plain_loop_with_batch_rb(name, world):
    batch = 8
    reference = plain_loop(name, batch * world)
    results = run_ranks(train_and_return_parameters, world, name, batch)
    for params, steps in results:
        assert steps == N_SAMPLES // (batch * world)
        assert_same_parameters(reference, params)


def test_one_process_equals_the_plain_loop():
    params, steps = train_and_return_parameters("mlp", 24)
    assert steps == N_SAMPLES // 24
    assert_same_parameters(plain_loop("mlp", 24), params)
