"""pytorch/examples ``mnist/main.py`` (per-epoch StepLR trainer with a test-set evaluation), in plain DDP.

    torchrun --nproc-per-node 2 examples/ports/mnist_steplr_ddp.py
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

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
    dist.all_reduce(sums)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main(argv=None):
    p = parser("digits, StepLR, test set each epoch", epochs=3, lr=1.0)
    p.add_argument("--gamma", type=float, default=0.7)
    p.add_argument("--save-model", default=None)
    args = p.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    train_set, test_set = digits(args.train_samples, args.test_samples)
    train_sampler = DistributedSampler(train_set, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=100, sampler=DistributedSampler(test_set, shuffle=False))
    model = DDP(Net())
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    history = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        loss = train(model, train_loader, optimizer)
        test_loss, accuracy = test(model, test_loader)
        scheduler.step()
        history.append({"train_loss": loss, "test_loss": test_loss, "accuracy": accuracy})
        if dist.get_rank() == 0:
            print(f"epoch {epoch + 1}: train loss {loss:.6f} test loss {test_loss:.6f} accuracy {accuracy:.4f}")
    if args.save_model and dist.get_rank() == 0:
        torch.save(model.module.state_dict(), args.save_model)
    return history


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
