"""R ranks with per-rank batch B take the same steps as one process with batch R*B (acceptance 3)."""
import pytest

from helpers import N_SAMPLES, assert_same_parameters, train_and_return_parameters
from multirank import run_ranks

@pytest.mark.parametrize("name", ["mlp", "simple-cnn"])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_batch_b_equal_one_process_with_batch_rb(name, world):
    batch = 8
    reference, ref_steps = train_and_return_parameters(name, batch * world)
    results = run_ranks(train_and_return_parameters, world, name, batch)
    for params, steps in results:
        assert steps == ref_steps == N_SAMPLES // (batch * world)
        assert_same_parameters(reference, params)
