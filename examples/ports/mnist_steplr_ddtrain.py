"""pytorch/examples ``mnist/main.py`` (per-epoch StepLR trainer with a test-set evaluation), ported to ddtrain.

    python examples/ports/mnist_steplr_ddtrain.py
    torchrun --nproc-per-node 2 examples/ports/mnist_steplr_ddtrain.py --strategy ring
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader

import ddtrain

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Net, digits, parser


def train(model, train_loader, optimizer):
    model.train()
    for data, target in train_loader:
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
    return loss.item()


def test(model, test_loader):
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)          # loss, correct, samples
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            sums += torch.tensor([F.nll_loss(output, target, reduction="sum").item(),
                                  output.argmax(dim=1).eq(target).sum().item(), len(target)], dtype=torch.float64)
    sums = ddtrain.all_reduce_metric(sums)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main(argv=None):
    p = parser("digits, StepLR, test set each epoch", epochs=3, lr=1.0)
    p.add_argument("--gamma", type=float, default=0.7)
    p.add_argument("--save-model", default=None)
    p.add_argument("--strategy", default="ddp")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    train_set, test_set = digits(args.train_samples, args.test_samples)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=100)
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    model, optimizer, train_loader, test_loader = ddtrain.prepare(model, optimizer, train_loader, test_loader,
                                                                  strategy=args.strategy)
    history = []
    for epoch in range(args.epochs):
        loss = train(model, train_loader, optimizer)
        test_loss, accuracy = test(model, test_loader)
        scheduler.step()
        history.append({"train_loss": loss, "test_loss": test_loss, "accuracy": accuracy})
        ddtrain.print0(f"epoch {epoch + 1}: train loss {loss:.6f} test loss {test_loss:.6f} accuracy {accuracy:.4f}")
    if args.save_model and ddtrain.rank() == 0:
        torch.save(model.state_dict(), args.save_model)
    return history


if __name__ == "__main__":
    main()
    ddtrain.shutdown()
