"""Horovod's ``examples/pytorch/pytorch_mnist.py`` (lr scaled by the number of workers, averaged metrics), in plain DDP.

    torchrun --nproc-per-node 2 examples/ports/horovod_mnist_ddp.py
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Net, digits, parser


def metric_average(value):
    tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).item()


def train(model, optimizer, train_loader, train_sampler, epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    for data, target in train_loader:
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
    return loss.item()


def test(model, test_loader, test_sampler):
    model.eval()
    test_loss, test_accuracy = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            test_accuracy += output.argmax(1).eq(target).float().sum().item()
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    return metric_average(test_loss), metric_average(test_accuracy)


def main(argv=None):
    p = parser("digits, Horovod-style: lr x workers, averaged metrics", epochs=2, lr=0.05)
    p.add_argument("--momentum", type=float, default=0.5)
    args = p.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    train_dataset, test_dataset = digits(args.train_samples, args.test_samples)
    train_sampler = DistributedSampler(train_dataset)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(test_dataset, shuffle=False)
    test_loader = DataLoader(test_dataset, batch_size=100, sampler=test_sampler)
    model = DDP(Net())
    lr_scaler = dist.get_world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    history = []
    for epoch in range(args.epochs):
        loss = train(model, optimizer, train_loader, train_sampler, epoch)
        test_loss, test_accuracy = test(model, test_loader, test_sampler)
        history.append({"train_loss": loss, "test_loss": test_loss, "accuracy": test_accuracy})
        if dist.get_rank() == 0:
            print(f"epoch {epoch + 1}: train loss {loss:.6f} test loss {test_loss:.6f} accuracy {test_accuracy:.4f}")
    return history


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
