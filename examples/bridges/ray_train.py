"""ddtrain inside Ray Train: a TorchTrainer whose workers call ddtrain.init() and ddtrain.prepare().

    pip install 'ray[train]'
    python examples/bridges/ray_train.py --workers 2 --strategy ring --epochs 3
    python examples/bridges/ray_train.py --workers 2 --epochs 5 --resume-from STORAGE/ddtrain-ray/checkpoint_...

Ray starts the workers and joins them in a Gloo (or NCCL) process group before ``train_func``
runs (``TorchConfig``: MASTER_ADDR/PORT set, ``init_process_group`` called with the worker's
world rank); ``ddtrain.init()`` finds the group and joins it as it is, and ``ddtrain.prepare``
wraps the model with the strategy, shards the loader and registers everything for
``ddtrain.save_state``. Each epoch's state is one ``ddtrain.save_state`` file (``ddtrain train``'s
checkpoint format, checksummed, ``ddtrain checkpoint info`` reads it) in the directory rank 0
reports to Ray; ``ray.train.get_checkpoint()`` hands it back to ``ddtrain.load_state`` on a
restart (Ray's ``FailureConfig``); ``--resume-from`` names an earlier run's.

Parameter-server strategies (ps-sync, ps-async) take extra ranks: ``ScalingConfig(num_workers=W+S)``
and ``ddtrain.init(strategy="ps-sync", servers=S)``, the last S workers being the servers. A
server serves inside ``prepare`` and then ends its process (``sys.exit(0)``), which Ray Train
counts as a worker lost, not as done: run those strategies with ``ddtrain run``/``ddtrain train``
(docs/BRIDGES.md). The replicated strategies (ddp, ring, tree, butterfly, central, hybrid,
local-sgd) need nothing more.
"""
import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ray
import ray.train
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import ddtrain


def train_func(config):
    ddtrain.init()                                 # joins the process group Ray made
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1200, 20, generator=generator)
    y = (x @ torch.randn(20, 5, generator=generator)).argmax(1)
    model = torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.ReLU(), torch.nn.Linear(48, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    # a global batch: the loader's order does not depend on the worker count, so a state loads at another
    model, optimizer, loader = ddtrain.prepare(model, optimizer, loader, strategy=config["strategy"],
                                               compression=config["compression"], global_batch_size=64)
    start = 0
    # Ray's own checkpoint after a worker failure (FailureConfig), else one named by the user: Ray Train 2
    # dropped TorchTrainer(resume_from_checkpoint=...) for this (ray-project/ray#49454)
    checkpoint = ray.train.get_checkpoint() or (Checkpoint.from_directory(config["resume_from"])
                                                if config["resume_from"] else None)
    if checkpoint:
        with checkpoint.as_directory() as directory:
            start = ddtrain.load_state(directory).epoch
    for epoch in range(start, config["epochs"]):
        total, count = 0.0, 0
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, count = total + loss.item() * len(yb), count + len(yb)
        loss = ddtrain.all_reduce_metric(total / count)    # the mean over the workers
        with tempfile.TemporaryDirectory() as directory:
            ddtrain.save_state(directory)                   # collective; rank 0 writes the file
            ray.train.report({"epoch": epoch, "loss": loss, "workers": ddtrain.world_size(), "first_epoch": start},
                             checkpoint=Checkpoint.from_directory(directory) if ddtrain.rank() == 0 else None)
        ddtrain.print0(f"ray + ddtrain.prepare(strategy={config['strategy']!r}), {ddtrain.world_size()} workers: "
                       f"epoch {epoch} loss {loss:.4f}")
    ddtrain.shutdown()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--strategy", default="ring")
    parser.add_argument("--compression", default="none")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--storage", default=os.path.abspath("ray_results"))
    parser.add_argument("--resume-from", default=None)     # a checkpoint directory an earlier run reported
    args = parser.parse_args(argv)
    if not ray.is_initialized():
        # one CPU per worker and one for the trainer's controller; no dashboard on a small machine
        ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=True)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"strategy": args.strategy, "compression": args.compression, "epochs": args.epochs,
                           "resume_from": args.resume_from},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="ddtrain-ray", storage_path=args.storage))
    result = trainer.fit()
    print(f"ray train done: last metrics {result.metrics}, checkpoint {result.checkpoint.path}")
    return result


if __name__ == "__main__":
    main()
