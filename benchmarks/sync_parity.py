"""Accuracy parity of the all-reduce strategies (document 001's experiment; our acceptance 5).

    torchrun --standalone --nproc-per-node 4 benchmarks/sync_parity.py \\
        --mnist ../shared/data/mnist --epochs 10 --out results/sync/sync_parity.json

Document 001 trained a 4-layer MLP on MNIST with MPI's all-reduce, a blocking ring and a
non-blocking ring and saw the rings end 7-10 accuracy points lower. Here every strategy
trains the same mlp (784-128-128-10) from the same seed on the same shards (the real MNIST
test set: 8,000 training / 2,000 validation images), batch 32 per rank, SGD lr 0.05 momentum
0.9, and rank 0 prints one row per strategy: the final validation accuracy per seed, their
mean, and the difference from ``ddp`` (the backend's own all-reduce).
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

import ddtrain
from ddtrain import TrainConfig, fit
from ddtrain.data import load_dataset
from ddtrain.models import build_model
from ddtrain.observe.files import write_json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mnist", required=True, help="directory with the MNIST IDX files")
    p.add_argument("--strategies", default="ddp,ring,ring-async,tree,butterfly,central")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--out", default=None, help="write the table as JSON here (rank 0)")
    args = p.parse_args()
    ddtrain.init()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    data = load_dataset(f"mnist:{args.mnist}", val_fraction=0.2, seed=0)
    strategies, seeds = args.strategies.split(","), [int(s) for s in args.seeds.split(",")]
    table = {s: [] for s in strategies}
    for seed in seeds:
        for strategy in strategies:
            torch.manual_seed(seed)
            model = build_model("mlp", num_classes=10, in_channels=1, input_size=(28, 28))
            config = TrainConfig.from_flat(model="mlp", data=data.name, strategy=strategy, epochs=args.epochs,
                                 batch_size=32, lr=0.05, momentum=0.9, seed=seed, quiet=True)
            table[strategy].append(fit(model, data, config)["final"]["val_accuracy"])
    if ddtrain.distributed.runtime.rank() == 0:
        reference = statistics.mean(table[strategies[0]])
        print(f"# mlp on MNIST t10k, {ddtrain.distributed.runtime.world_size()} ranks, {args.epochs} epochs; "
              f"validation accuracy (%) per seed {seeds}")
        print(f"# {'strategy':<11} {'per seed':<24} {'mean':>6} {'vs ' + strategies[0]:>8}")
        for strategy, accuracies in table.items():
            mean = statistics.mean(accuracies)
            print(f"  {strategy:<11} {' '.join(f'{100 * a:6.2f}' for a in accuracies):<24} "
                  f"{100 * mean:6.2f} {100 * (mean - reference):+8.2f}")
        if args.out:
            write_json(args.out, {"epochs": args.epochs, "seeds": seeds, "world_size": ddtrain.distributed.runtime.world_size(),
                                  "val_accuracy": table})
    ddtrain.shutdown()


if __name__ == "__main__":
    main()
