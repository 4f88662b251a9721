"""pytorch/examples ``distributed/ddp-tutorial-series/multigpu_torchrun.py`` (a ``Trainer`` with snapshots), in plain DDP.

    torchrun --nproc-per-node 2 examples/ports/trainer_snapshot_ddp.py --snapshot-path /tmp/snapshot.pt
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Net, digits, parser


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.losses = []
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        if self.global_rank == 0:
            print(f"resuming from snapshot {snapshot_path} at epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.nll_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            loss = self._run_batch(source, targets)
        self.losses.append(loss)
        if self.global_rank == 0:
            print(f"epoch {epoch}: {len(self.train_data)} steps, last loss {loss:.6f}")

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)

    def train(self, max_epochs):
        if self.epochs_run >= max_epochs and self.global_rank == 0:   # was: nothing at all, exit 0 (issue 32)
            print(f"snapshot {self.snapshot_path} already holds {self.epochs_run} epoch(s) of {max_epochs}: nothing "
                  f"to train (give more --epochs to go on, or remove the snapshot to start again)")
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def main(argv=None):
    p = parser("digits, a Trainer class with snapshot save and resume", epochs=3, lr=0.1)
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--snapshot-path", default="snapshot.pt")
    args = p.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    train_set, _ = digits(args.train_samples, args.test_samples)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    train_data = DataLoader(train_set, batch_size=args.batch_size, shuffle=False, sampler=DistributedSampler(train_set))
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path)
    trainer.train(args.epochs)
    return trainer.losses


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
