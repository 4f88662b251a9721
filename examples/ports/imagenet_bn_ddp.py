"""pytorch/examples ``imagenet/main.py`` with BatchNorm and ReduceLROnPlateau on the validation loss, in plain DDP.

    torchrun --nproc-per-node 2 examples/ports/imagenet_bn_ddp.py --checkpoint /tmp/bn.pt
"""
import os
import shutil
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BNNet, digits, parser


class AverageMeter:
    """A running sum and count; ``all_reduce`` sums them over the ranks."""

    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, value, n=1):
        self.sum, self.count = self.sum + value * n, self.count + n

    def all_reduce(self):
        total = torch.tensor([self.sum, self.count], dtype=torch.float64)
        dist.all_reduce(total)
        self.sum, self.count = total.tolist()

    @property
    def avg(self):
        return self.sum / max(self.count, 1)


def accuracy(output, target):
    return output.argmax(1).eq(target).float().mean().item() * 100


def train(train_loader, model, criterion, optimizer):
    model.train()
    losses = AverageMeter()
    for images, target in train_loader:
        loss = criterion(model(images), target)
        losses.update(loss.item(), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses.avg


def validate(val_loader, model, criterion, aux_val_loader=None):
    losses, top1 = AverageMeter(), AverageMeter()

    def run_validate(loader):
        with torch.no_grad():
            for images, target in loader:
                output = model(images)
                losses.update(criterion(output, target).item(), images.size(0))
                top1.update(accuracy(output, target), images.size(0))

    model.eval()
    run_validate(val_loader)
    losses.all_reduce()
    top1.all_reduce()
    if aux_val_loader is not None:       # the samples DistributedSampler(drop_last=True) left out, on every rank
        run_validate(aux_val_loader)
    return losses.avg, top1.avg


def main(argv=None):
    p = parser("digits, ImageNet-style with BatchNorm and ReduceLROnPlateau", epochs=4, lr=0.1, batch_size=16)
    p.add_argument("--checkpoint", default="")
    args = p.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    train_dataset, val_dataset = digits(args.train_samples, args.test_samples)
    model = DDP(BNNet())
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    train_sampler = DistributedSampler(train_dataset, seed=args.seed)
    val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    val_loader = DataLoader(val_dataset, batch_size=32, sampler=val_sampler)
    aux_val_loader = None
    if len(val_sampler) * dist.get_world_size() < len(val_dataset):
        rest = Subset(val_dataset, range(len(val_sampler) * dist.get_world_size(), len(val_dataset)))
        aux_val_loader = DataLoader(rest, batch_size=32)
    best_acc1, history = 0.0, []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_loss = train(train_loader, model, criterion, optimizer)
        val_loss, acc1 = validate(val_loader, model, criterion, aux_val_loader)
        scheduler.step(val_loss)
        is_best, best_acc1 = acc1 > best_acc1, max(acc1, best_acc1)
        history.append({"train_loss": train_loss, "val_loss": val_loss, "acc1": acc1,
                        "lr": optimizer.param_groups[0]["lr"]})
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.6f} val loss {val_loss:.6f} acc@1 {acc1:.3f} "
                  f"lr {optimizer.param_groups[0]['lr']:g}")
            if args.checkpoint:
                torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "best_acc1": best_acc1,
                            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, args.checkpoint)
                if is_best:
                    shutil.copyfile(args.checkpoint, args.checkpoint + ".best")
    return {"history": history, "state": model.module.state_dict()}


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
