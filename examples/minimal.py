"""The minimal-change path: an ordinary PyTorch training script plus three ddtrain lines.

Runs unchanged as one process or under any launcher:
    python examples/minimal.py
    torchrun --nproc-per-node 2 examples/minimal.py
    srun -n 8 python examples/minimal.py          (SLURM)
    mpirun.openmpi -n 4 python examples/minimal.py   (Open MPI, one host)
    mpiexec.mpich -n 4 python examples/minimal.py    (MPICH/Hydra, one host; name the launcher: unsuffixed, it may be either)
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ddtrain
from ddtrain.data import load_dataset
from ddtrain.models import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default=None)   # None: ddp, or what `ddtrain run --strategy` says
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

ddtrain.init()                                                   # added line 1
torch.manual_seed(0)
data = load_dataset("digits", val_fraction=0.0)
model = build_model("mlp", num_classes=10, in_channels=1, input_size=(28, 28))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(data.train, batch_size=32, shuffle=True)
model, optimizer, loader = ddtrain.prepare(model, optimizer, loader, strategy=args.strategy)  # added line 2

for epoch in range(args.epochs):
    total, count = 0.0, 0
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total, count = total + loss.item() * len(y), count + len(y)
    ddtrain.print0(f"epoch {epoch + 1}: loss {total / count:.4f} on rank 0's {count} samples "
                   f"(world size {ddtrain.world_size()})")
ddtrain.shutdown()                                               # added line 3
