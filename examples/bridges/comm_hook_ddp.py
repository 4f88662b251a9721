"""ddtrain's all-reduce algorithms and compressors inside a plain DistributedDataParallel script.

The script is ordinary torch: its own init_process_group, its own DDP, its own loop. One ddtrain
line makes the hook, one torch line registers it:
    torchrun --nproc-per-node 3 examples/bridges/comm_hook_ddp.py --algorithm ring
    torchrun --nproc-per-node 3 examples/bridges/comm_hook_ddp.py --algorithm tree --compression powersgd:2
    torchrun --nproc-per-node 2 examples/bridges/comm_hook_ddp.py --compression fp16 --checkpoint /tmp/ck.pt
With --checkpoint the hook's state (error feedback, PowerSGD's Q) is saved per rank beside the
model and taken back on the next start, as torch's own PowerSGD state is.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import ddtrain
from ddtrain.data import load_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--algorithm", default="ring")      # ddtrain.comm.ALGORITHMS: ring, tree, butterfly, central, ...
parser.add_argument("--compression", default=None)      # fp16, bf16, powersgd:RANK, topk:FRACTION
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--checkpoint", default=None)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
data = load_dataset("digits", val_fraction=0.0).train
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

state, hook = ddtrain.comm_hook(algorithm=args.algorithm, compression=args.compression, model=model)
start_epoch = 0
path = f"{args.checkpoint}.rank{rank}" if args.checkpoint else None   # the hook's state differs per rank
if path and os.path.exists(path):
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state.load_state_dict(saved["comm_hook"])
    start_epoch = saved["epoch"]
ddp = DDP(model)
ddp.register_comm_hook(state, hook)

sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=32, sampler=sampler)
for epoch in range(start_epoch, start_epoch + args.epochs):
    sampler.set_epoch(epoch)
    total, count = 0.0, 0
    for x, y in loader:
        loss = F.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total, count = total + loss.item() * len(y), count + len(y)
    if rank == 0:
        print(f"epoch {epoch} loss {total / count:.4f} ({args.algorithm}, compression {args.compression})")
if path:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "comm_hook": state.state_dict(),
                "epoch": start_epoch + args.epochs}, path)
traffic = state.traffic()
print(f"rank {rank}: {traffic.bytes_sent} bytes sent by the hook, {traffic.extra['buckets_reduced']} buckets")
dist.destroy_process_group()
