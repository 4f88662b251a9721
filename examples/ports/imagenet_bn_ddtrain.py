"""pytorch/examples ``imagenet/main.py`` with BatchNorm and ReduceLROnPlateau on the validation loss, ported to ddtrain.

    python examples/ports/imagenet_bn_ddtrain.py
    torchrun --nproc-per-node 2 examples/ports/imagenet_bn_ddtrain.py --checkpoint /tmp/bn.pt
    ddtrain run --nproc 3 --strategy ps-sync examples/ports/imagenet_bn_ddtrain.py
"""
import os
import shutil
import sys

import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader

import ddtrain

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BNNet, digits, parser


class AverageMeter:
    """A running sum and count; ``all_reduce`` sums them over the ranks."""

    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, value, n=1):
        self.sum, self.count = self.sum + value * n, self.count + n

    def all_reduce(self):
        self.sum, self.count = ddtrain.all_reduce_metric(self.sum), ddtrain.all_reduce_metric(self.count)

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


def validate(val_loader, model, criterion):
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
    return losses.avg, top1.avg


def main(argv=None):
    p = parser("digits, ImageNet-style with BatchNorm and ReduceLROnPlateau", epochs=4, lr=0.1, batch_size=16)
    p.add_argument("--checkpoint", default="")
    p.add_argument("--strategy", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    train_dataset, val_dataset = digits(args.train_samples, args.test_samples)
    model = BNNet()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val_dataset, batch_size=32)
    # eval_remainder="uneven": every validation sample once, what the twin's drop_last=True and aux loader achieve
    model, optimizer, train_loader, val_loader = ddtrain.prepare(model, optimizer, train_loader, val_loader,
                                                                 strategy=args.strategy, seed=args.seed,
                                                                 eval_remainder="uneven")
    best_acc1, history = 0.0, []
    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        train_loss = train(train_loader, model, criterion, optimizer)
        val_loss, acc1 = validate(val_loader, model, criterion)
        scheduler.step(val_loss)
        is_best, best_acc1 = acc1 > best_acc1, max(acc1, best_acc1)
        history.append({"train_loss": train_loss, "val_loss": val_loss, "acc1": acc1,
                        "lr": optimizer.param_groups[0]["lr"]})
        if ddtrain.rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.6f} val loss {val_loss:.6f} acc@1 {acc1:.3f} "
                  f"lr {optimizer.param_groups[0]['lr']:g}")
            if args.checkpoint:
                torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "best_acc1": best_acc1,
                            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, args.checkpoint)
                if is_best:
                    shutil.copyfile(args.checkpoint, args.checkpoint + ".best")
    return {"history": history, "state": model.state_dict()}


if __name__ == "__main__":
    main()
    ddtrain.shutdown()
