"""ddtrain.prepare inside a Lightning Fabric script: Fabric launches and joins the processes, ddtrain synchronises.

    pip install lightning
    python examples/bridges/fabric_prepare.py --devices 2 --strategy tree

Fabric starts the processes and sets up the Gloo process group (``fabric.launch()``); ddtrain.init()
finds that group and joins it as it is. The model, optimizer and loader then go to
``ddtrain.prepare`` instead of ``fabric.setup``/``setup_dataloaders`` (both would wrap the model in
DDP: one synchronisation, not two), and the loop calls ``loss.backward()``, not
``fabric.backward`` (Fabric's strategy holds no wrapped model here). Fabric's precision plugins
and its checkpoint helpers are left out for that reason: ``ddtrain.save_state``/``load_state``
save what prepare returned.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

import ddtrain

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--strategy", default="ring")     # a ddtrain strategy (ddtrain.sync.STRATEGIES)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy="ddp")
fabric.launch()                      # this script, once per device, with the process group joined
ddtrain.init()

torch.manual_seed(0)
generator = torch.Generator().manual_seed(0)
x = torch.randn(1200, 20, generator=generator)
y = (x @ torch.randn(20, 5, generator=generator)).argmax(1)
model = torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.ReLU(), torch.nn.Linear(48, 5))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
model, optimizer, loader = ddtrain.prepare(model, optimizer, loader, strategy=args.strategy)

for epoch in range(args.epochs):
    total, count = 0.0, 0
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total, count = total + loss.item() * len(yb), count + len(yb)
    ddtrain.print0(f"fabric + ddtrain.prepare(strategy={args.strategy!r}), {ddtrain.world_size()} workers: "
                   f"epoch {epoch} loss {total / count:.4f}")
ddtrain.shutdown()
