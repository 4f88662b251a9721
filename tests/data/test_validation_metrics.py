"""Validation metrics are exact global means (issue 22): fewer validation samples than ranks gave
`val_loss: nan`; a tail batch of one sample was dropped. Checked on 4 Gloo ranks against a plain
single-process computation over the whole set."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from multirank import run_ranks
from ddtrain.data.arrays import ArrayDataset


def _set(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return ArrayDataset(torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g), num_classes=3)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))


def _reference(n: int):
    ds, model = _set(n), _model()
    with torch.no_grad():
        out = model(ds.x)
    return F.cross_entropy(out, ds.y).item(), (out.argmax(1) == ds.y).double().mean().item()


def _evaluate_on_ranks(n: int, batch_size: int):
    from ddtrain.training.evaluate import evaluate
    return evaluate(_model(), _set(n), worker_rank=dist.get_rank(), workers=dist.get_world_size(),
                    batch_size=batch_size, device=torch.device("cpu"), task="classification", group=None,
                    distributed=True)


def test_fewer_validation_samples_than_ranks_give_the_exact_mean():
    """Was: val_loss nan, val_accuracy None on every rank (4 ranks, 3 samples)."""
    loss, accuracy = _reference(3)
    for got_loss, got_accuracy in run_ranks(_evaluate_on_ranks, 4, 3, 8):
        assert abs(got_loss - loss) < 1e-6 and abs(got_accuracy - accuracy) < 1e-12


def test_uneven_shards_and_a_one_sample_tail_batch_count_every_sample_once():
    """21 samples on 4 ranks: shards of 6, 5, 5, 5; batch 5 leaves rank 0 a tail batch of one (was dropped)."""
    loss, accuracy = _reference(21)
    for got_loss, got_accuracy in run_ranks(_evaluate_on_ranks, 4, 21, 5):
        assert abs(got_loss - loss) < 1e-6 and abs(got_accuracy - accuracy) < 1e-12
