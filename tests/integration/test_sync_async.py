"""ps-async against ps-sync on real data, and the staleness bound (acceptance 3).

simple-cnn on the real MNIST test set (t10k: 8,000 training and 2,000 validation images),
3 workers + 1 server, one epoch, the same seed, per-worker batch (16) and momentum for both:
the asynchronous server must end within 2 accuracy points of the synchronous one, and no
update it applied may be staler than ``--staleness``. (Measured: ps-sync 95.25, ps-async
94.25-95.65 over five runs; the arrival order, hence ps-async's result, varies run to run.
On a subset of 4,800 images ps-async varied too much between runs for a 2-point margin.)

Learning rates: one ps-sync update averages the 3 workers' gradients (a global batch of 48)
while ps-async applies each worker's batch of 16 as an update of its own, so per sample
ps-async takes 3x the steps. With the same rate for both, ps-sync trails (measured: 91.35
against 94.25 after this test's epoch at lr 0.05, docs/REPRODUCING.md). The
synchronous run therefore uses the linear scaling rule, lr x workers (0.15 against 0.05),
so both move the same distance per sample, and what is compared is the cost of staleness.
The pure logic of the staleness gate is checked without processes.
"""
import pytest
import torch

from ddtrain import TrainConfig, fit
from ddtrain.data import load_dataset
from ddtrain.data.loading import steps_per_epoch
from ddtrain.models import build_model
from ddtrain.sync.ps.serve_async import feasible
from multirank import run_ranks

WORLD = 4              # 3 workers + 1 server
TRAIN_SAMPLES = 8000   # 2,666 per worker (2 dropped), 167 steps of up to 16
EPOCHS, STALENESS, BATCH, LR = 1, 1, 16, 0.05
WORKERS = WORLD - 1


def train_mnist(mnist_dir, strategy):
    data = load_dataset(f"mnist:{mnist_dir}", val_fraction=0.2, seed=0)
    assert len(data.train) == TRAIN_SAMPLES
    torch.manual_seed(0)
    model = build_model("simple-cnn", num_classes=10, in_channels=1, input_size=(28, 28))
    lr = LR * WORKERS if strategy == "ps-sync" else LR     # linear scaling rule, see the module docstring
    # the rates above are tuned for the uncorrected algorithm; ps-sync reads neither option (it would refuse them)
    asynchrony = {"staleness": STALENESS, "async_rule": "plain"} if strategy == "ps-async" else {}
    config = TrainConfig.from_flat(model="simple-cnn", data=data.name, strategy=strategy, epochs=EPOCHS,
                                   batch_size=BATCH, lr=lr, momentum=0.5, seed=0, quiet=True, **asynchrony)
    record = fit(model, data, config)
    return record["final"].get("val_accuracy"), record["comm"]


@pytest.mark.slow
def test_ps_async_reaches_ps_sync_accuracy_within_the_staleness_bound(mnist_dir):
    sync_accuracy, _ = run_ranks(train_mnist, WORLD, str(mnist_dir), "ps-sync", timeout_s=600)[0]
    async_accuracy, comm = run_ranks(train_mnist, WORLD, str(mnist_dir), "ps-async", timeout_s=600)[0]
    print(f"ps-sync {sync_accuracy:.4f}  ps-async {async_accuracy:.4f}")
    assert sync_accuracy > 0.85 and abs(async_accuracy - sync_accuracy) <= 0.02
    server = comm[-1]
    assert server["role"] == "server" and server["staleness_bound"] == STALENESS
    assert 0 <= server["staleness_max"] <= STALENESS
    steps = steps_per_epoch(TRAIN_SAMPLES // WORKERS, BATCH)
    assert sum(server["staleness_histogram"].values()) == server["updates"] == EPOCHS * WORKERS * steps


@pytest.mark.parametrize("outstanding, worker, version, bound, expected", [
    ({0: 3}, 0, 3, 0, True),                  # alone, fresh
    ({0: 3, 1: 3}, 0, 3, 0, False),           # applying would leave worker 1 one version behind
    ({0: 3, 1: 3}, 0, 3, 1, True),
    ({0: 2, 1: 3}, 1, 3, 1, False),           # the older gradient of worker 0 must go first ...
    ({0: 2, 1: 3}, 0, 3, 1, True),            # ... and it may
    ({0: 1, 1: 3}, 0, 3, 1, False),           # already 2 versions stale
])
def test_the_staleness_gate(outstanding, worker, version, bound, expected):
    assert feasible(outstanding, worker, version, bound) is expected

