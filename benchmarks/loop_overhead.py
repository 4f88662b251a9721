"""ddtrain's training loop against a plain PyTorch loop in one process: CPU seconds per step.

    python benchmarks/loop_overhead.py --repeats 12

The controlled half of docs/PERFORMANCE.md "Overhead against plain DDP": a world of one
(no communication), one thread, the same model, batches and optimizer; ``ddtrain.fit``
against ``forward, loss, zero_grad, backward, step`` over the same in-memory tensors,
alternating which goes first. Per run: this process's CPU seconds (``time.process_time``)
from the end of step ``--warmup-steps`` to the end of the run, per step. CPU time, unlike
wall time, hardly moves when other processes compete for the cores, so small per-step costs
of the loop (its checks, metrics and bookkeeping) are visible. Prints every run, the ratio of
the medians and the ratio of the fastest runs.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ddtrain import Callback, TrainConfig, fit
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.models import build_model


class _Clock(Callback):
    def __init__(self, warmup):
        self.warmup = warmup

    def on_step_end(self, step, logs, state):
        if step == self.warmup:
            self.t0 = time.process_time()

    def on_train_end(self, record, state):
        self.t1 = time.process_time()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="simple-cnn")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=12)
    args = p.parse_args()
    torch.set_num_threads(1)
    n, b, w = args.steps, args.batch_size, args.warmup_steps
    x = torch.randn(n * b, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    y = torch.arange(n * b) % 10
    data = Data("synthetic", ArrayDataset(x, y, num_classes=10), None, 10, (1, 28, 28), "classification")

    def model():
        torch.manual_seed(0)
        return build_model(args.model, num_classes=10, in_channels=1, input_size=(28, 28))

    def ddtrain_run():
        clock = _Clock(w)
        fit(model(), data, TrainConfig.from_flat(model=args.model, data="synthetic", epochs=0, steps=n, batch_size=b, lr=0.05,
                                       val_fraction=0.0, quiet=True), callbacks=[clock])
        return (clock.t1 - clock.t0) / (n - w)   # the end-of-run work after the last step included

    def plain_run():
        m = model()
        optimizer = torch.optim.SGD(m.parameters(), lr=0.05)
        order = torch.randperm(n * b)
        for step in range(n):
            if step == w:
                t0 = time.process_time()
            i = order[step * b:(step + 1) * b]
            loss = F.cross_entropy(m(x[i]), y[i])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return (time.process_time() - t0) / (n - w)

    runs = {"ddtrain": [], "plain": []}
    for r in range(args.repeats):
        for name, fn in ((("ddtrain", ddtrain_run), ("plain", plain_run)) if r % 2 == 0
                         else (("plain", plain_run), ("ddtrain", ddtrain_run))):
            runs[name].append(fn())
    for name, values in runs.items():
        print(f"# {name:>7} CPU ms/step: " + " ".join(f"{1e3 * v:.2f}" for v in values))
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"ddtrain / plain: ratio of medians {med['ddtrain'] / med['plain']:.3f} "
          f"({1e3 * med['ddtrain']:.2f} vs {1e3 * med['plain']:.2f} ms), "
          f"ratio of fastest runs {min(runs['ddtrain']) / min(runs['plain']):.3f}")


if __name__ == "__main__":
    main()
