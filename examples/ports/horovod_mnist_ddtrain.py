"""Horovod's ``examples/pytorch/pytorch_mnist.py`` (lr scaled by the number of workers, averaged metrics), ported to ddtrain.

    python examples/ports/horovod_mnist_ddtrain.py
    torchrun --nproc-per-node 2 examples/ports/horovod_mnist_ddtrain.py --strategy hybrid
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ddtrain

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Net, digits, parser


def metric_average(value):
    return ddtrain.all_reduce_metric(value, "mean")


def train(model, optimizer, train_loader, epoch):
    model.train()
    train_loader.set_epoch(epoch)
    for data, target in train_loader:
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
    return loss.item()


def test(model, test_loader):
    model.eval()
    test_loss, test_accuracy = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            test_accuracy += output.argmax(1).eq(target).float().sum().item()
    test_loss /= len(test_loader.sampler)
    test_accuracy /= len(test_loader.sampler)
    return metric_average(test_loss), metric_average(test_accuracy)


def main(argv=None):
    p = parser("digits, Horovod-style: lr x workers, averaged metrics", epochs=2, lr=0.05)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--strategy", default="ddp")
    args = p.parse_args(argv)
    ddtrain.init(strategy=args.strategy)   # world_size() below counts workers (parameter servers excluded)
    torch.manual_seed(args.seed)
    train_dataset, test_dataset = digits(args.train_samples, args.test_samples)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_dataset, batch_size=100)
    model = Net()
    lr_scaler = ddtrain.world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    model, optimizer, train_loader, test_loader = ddtrain.prepare(model, optimizer, train_loader, test_loader,
                                                                  strategy=args.strategy)
    history = []
    for epoch in range(args.epochs):
        loss = train(model, optimizer, train_loader, epoch)
        test_loss, test_accuracy = test(model, test_loader)
        history.append({"train_loss": loss, "test_loss": test_loss, "accuracy": test_accuracy})
        ddtrain.print0(f"epoch {epoch + 1}: train loss {loss:.6f} test loss {test_loss:.6f} accuracy {test_accuracy:.4f}")
    return history


if __name__ == "__main__":
    main()
    ddtrain.shutdown()
