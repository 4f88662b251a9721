"""timm's ``train.py`` (a model EMA, AdamW without weight decay on norms and biases, a per-update warm-up and cosine
schedule, bf16 autocast, label smoothing, ``distribute_bn`` at each epoch's end, validation of the model and of its
EMA), in plain DDP.

    torchrun --nproc-per-node 2 examples/ports/timm_style_ddp.py --output /tmp/timm
"""
import os
import sys
from copy import deepcopy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BNNet, digits, parser


class ModelEma:
    """timm's ``ModelEmaV2``: a deep copy of the model whose weights follow it as an exponential moving average."""

    def __init__(self, model, decay=0.9):
        self.module = deepcopy(model)
        self.module.eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_v.copy_(ema_v * self.decay + (1.0 - self.decay) * model_v)
            else:
                ema_v.copy_(model_v)


def reduce_tensor(tensor, n):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= n
    return rt


def distribute_bn(model, world_size, reduce=False):
    """timm's: average (or take rank 0's) BatchNorm running statistics across the ranks."""
    for name, buffer in model.named_buffers(recurse=True):
        if "running_mean" in name or "running_var" in name:
            if reduce:
                dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
                buffer /= float(world_size)
            else:
                dist.broadcast(buffer, 0)


def param_groups_weight_decay(model, weight_decay):
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def train_one_epoch(model, loader, optimizer, loss_fn, lr_scheduler, model_ema, amp):
    model.train()
    losses = []
    for input, target in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            output = model(input)
            loss = loss_fn(output, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model_ema.update(model)
        lr_scheduler.step()
        losses.append(loss.item())
    return sum(losses) / len(losses)


def validate(model, loader, loss_fn, world_size):
    model.eval()
    loss_sum = top1_sum = count = 0.0
    with torch.no_grad():
        for input, target in loader:
            output = model(input)
            loss = loss_fn(output, target)
            top1 = output.argmax(1).eq(target).float().mean() * 100
            if world_size > 1:
                loss, top1 = reduce_tensor(loss.data, world_size), reduce_tensor(top1, world_size)
            loss_sum += loss.item() * input.size(0)
            top1_sum += top1.item() * input.size(0)
            count += input.size(0)
    return {"loss": loss_sum / count, "top1": top1_sum / count}


def main(argv=None):
    p = parser("digits, timm-style: EMA, AdamW, warm-up and cosine per update, bf16, distribute_bn", epochs=3,
               lr=0.01, batch_size=16)
    p.add_argument("--warmup-updates", type=int, default=5)
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--output", default="")
    args = p.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(args.seed)
    train_set, eval_set = digits(args.train_samples, args.test_samples)
    model = BNNet()
    model_ema = ModelEma(model)            # timm: after the model is on its device, before DDP
    model = DDP(model)
    optimizer = torch.optim.AdamW(param_groups_weight_decay(model, 0.05), lr=args.lr)
    loader_train = DataLoader(train_set, batch_size=args.batch_size, sampler=DistributedSampler(train_set, seed=args.seed),
                              drop_last=True)
    loader_eval = DataLoader(eval_set, batch_size=32, sampler=DistributedSampler(eval_set, shuffle=False))
    updates_per_epoch = len(loader_train)
    lr_scheduler = SequentialLR(optimizer, [
        LinearLR(optimizer, start_factor=0.1, total_iters=args.warmup_updates),
        CosineAnnealingLR(optimizer, T_max=args.epochs * updates_per_epoch - args.warmup_updates)],
        milestones=[args.warmup_updates])
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    history = []
    for epoch in range(args.epochs):
        loader_train.sampler.set_epoch(epoch)
        train_loss = train_one_epoch(model, loader_train, optimizer, loss_fn, lr_scheduler, model_ema, args.amp)
        if world_size > 1:
            distribute_bn(model, world_size, reduce=True)
        eval_metrics = validate(model, loader_eval, loss_fn, world_size)
        ema_metrics = validate(model_ema.module, loader_eval, loss_fn, world_size)
        history.append({"train_loss": train_loss, **eval_metrics, **{f"ema_{k}": v for k, v in ema_metrics.items()},
                        "lr": optimizer.param_groups[0]["lr"]})
        if rank == 0:
            print(f"epoch {epoch}: train loss {train_loss:.6f} eval loss {eval_metrics['loss']:.6f} "
                  f"top1 {eval_metrics['top1']:.3f} ema top1 {ema_metrics['top1']:.3f}")
            if args.output:
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                            "state_dict_ema": model_ema.module.state_dict()}, os.path.join(args.output, "last.pth.tar"))
                torch.save(model_ema.module, os.path.join(args.output, "ema_model.pt"))
    return {"history": history, "state": model.module.state_dict(), "ema": model_ema.module.state_dict()}


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
