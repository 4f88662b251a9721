"""pytorch/examples ``imagenet/main.py`` (``--resume``, best-accuracy checkpoints, metrics averaged across ranks),
ported to ddtrain.

    python examples/ports/imagenet_style_ddtrain.py --checkpoint /tmp/ckpt.pt
    torchrun --nproc-per-node 2 examples/ports/imagenet_style_ddtrain.py --checkpoint /tmp/ckpt.pt --resume
    /tmp/ckpt.pt --epochs 4
"""
import os
import shutil
import sys

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader

import ddtrain

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Net, digits, parser


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


def train(train_loader, model, optimizer):
    model.train()
    losses = AverageMeter()
    for images, target in train_loader:
        loss = F.nll_loss(model(images), target)
        losses.update(loss.item(), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses.avg


def validate(val_loader, model):
    model.eval()
    losses, top1 = AverageMeter(), AverageMeter()

    def run(loader):
        with torch.no_grad():
            for images, target in loader:
                output = model(images)
                losses.update(F.nll_loss(output, target).item(), images.size(0))
                top1.update(output.argmax(1).eq(target).float().mean().item() * 100, images.size(0))

    run(val_loader)
    losses.all_reduce()
    top1.all_reduce()
    return losses.avg, top1.avg


def main(argv=None):
    p = parser("digits, ImageNet-style trainer with --resume", epochs=2, lr=0.1)
    p.add_argument("--resume", default="")
    p.add_argument("--checkpoint", default="checkpoint.pt")
    p.add_argument("--strategy", default="ddp")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    train_dataset, val_dataset = digits(args.train_samples, args.test_samples)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.5)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val_dataset, batch_size=100)
    model, optimizer, train_loader, val_loader = ddtrain.prepare(model, optimizer, train_loader, val_loader,
                                                                 strategy=args.strategy, eval_remainder="uneven")
    start_epoch, best_acc1 = 0, 0.0
    if args.resume:
        checkpoint = torch.load(args.resume)
        start_epoch, best_acc1 = checkpoint["epoch"], checkpoint["best_acc1"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
    history = []
    for epoch in range(start_epoch, args.epochs):
        train_loader.set_epoch(epoch)
        train_loss = train(train_loader, model, optimizer)
        val_loss, acc1 = validate(val_loader, model)
        scheduler.step()
        is_best, best_acc1 = acc1 > best_acc1, max(acc1, best_acc1)
        history.append({"train_loss": train_loss, "val_loss": val_loss, "acc1": acc1})
        if ddtrain.rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.6f} val loss {val_loss:.6f} acc@1 {acc1:.3f}")
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "best_acc1": best_acc1,
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, args.checkpoint)
            if is_best:
                shutil.copyfile(args.checkpoint, args.checkpoint + ".best")
    return history


if __name__ == "__main__":
    main()
    ddtrain.shutdown()
