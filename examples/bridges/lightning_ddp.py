"""ddtrain's all-reduce algorithms and compressors inside PyTorch Lightning's DDP strategy.

    pip install lightning
    python examples/bridges/lightning_ddp.py --devices 2 --algorithm tree --compression powersgd:2

Lightning starts the other processes itself (it runs this script again with LOCAL_RANK set), so
every process builds its own hook state here, at module level, as Lightning asks of a
``ddp_comm_state``. Lightning 2.x registers a ``ddp_comm_hook`` only when the device is CUDA
(``DDPStrategy._register_ddp_hooks``: "DDP communication hooks only work with NCCL", no longer
true: torch runs them on Gloo too); ``AnyDeviceDDPStrategy`` below registers it on the CPU as
well. On GPUs the stock ``DDPStrategy`` does.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.ddp import _register_ddp_comm_hook

import ddtrain


class AnyDeviceDDPStrategy(DDPStrategy):
    """Lightning's DDPStrategy, registering its communication hook on every device (Gloo on CPU too)."""

    def _register_ddp_hooks(self) -> None:
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.ReLU(), torch.nn.Linear(48, 5))
        self.losses = []

    def training_step(self, batch, batch_index):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def dataset():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1200, 20, generator=generator)
    y = (x @ torch.randn(20, 5, generator=generator)).argmax(1)   # a learnable labelling
    return TensorDataset(x, y)


parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--algorithm", default="ring")
parser.add_argument("--compression", default=None)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--out", default=None)           # rank 0 writes the losses and each rank's hook traffic here
args = parser.parse_args()

L.seed_everything(0, verbose=False)
model = Classifier()
state, hook = ddtrain.comm_hook(algorithm=args.algorithm, compression=args.compression, model=model)
strategy = AnyDeviceDDPStrategy(process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=hook)
trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                    enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False)
trainer.fit(model, DataLoader(dataset(), batch_size=32, shuffle=True))

# what every rank holds at the end, gathered to rank 0: the hook's buckets and a digest of the parameters
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
mine = {"rank": trainer.global_rank, "buckets_reduced": state.traffic().extra["buckets_reduced"],
        "bytes_sent": state.traffic().bytes_sent, "parameters": flat.tolist()}
everyone = [None] * trainer.world_size
torch.distributed.all_gather_object(everyone, mine)
if trainer.global_rank == 0:
    first, last = sum(model.losses[:10]) / 10, sum(model.losses[-10:]) / 10
    print(f"lightning + ddtrain.comm_hook({args.algorithm!r}, {args.compression!r}): {trainer.world_size} workers, "
          f"loss {first:.4f} -> {last:.4f}, buckets reduced by the hook per rank "
          f"{[r['buckets_reduced'] for r in everyone]}, replicas equal: "
          f"{all(r['parameters'] == everyone[0]['parameters'] for r in everyone)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"first_loss": first, "last_loss": last, "ranks": everyone}, f)
