"""A prepare() script that survives preemption and changes of size: its state saved on a stop signal, loaded when run again.

    ddtrain run --nproc 2 --checkpoint-dir ck examples/preemptible.py
        # SIGTERM (Ctrl-C, a scheduler's stop) -> every worker finishes the same step, the state is
        # written to ck and the launcher exits 75; the same command again goes on from there, to the bit
    ddtrain run --nproc 2:3 --checkpoint-dir ck --global-batch-size 48 examples/preemptible.py
        # a global batch: the state loads at any worker count that divides it (run it again with --nproc 3)
    python examples/preemptible.py --checkpoint-dir ck          # one process, the same

Four lines beyond examples/minimal.py's: ``load_state`` before the loop (None the first time),
the loop starting at the epoch it returns, and ``stop_requested`` / ``save_state`` after the
optimizer step. (Without them, ``prepare`` does the same by itself when a checkpoint directory is
set: docs/PORTING.md, "Saving, resuming, preemption".)
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ddtrain
from ddtrain.data import load_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--checkpoint-dir", default=None, help="default: ddtrain run --checkpoint-dir's")
parser.add_argument("--dropout", type=float, default=0.0)
parser.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step (time to send a signal)")
parser.add_argument("--out", default=None, help="rank 0 writes the final parameters and a few facts here (torch.save)")
args = parser.parse_args()

ddtrain.init()
torch.manual_seed(0)
data = load_dataset("digits", val_fraction=0.0)
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 64), torch.nn.ReLU(),
                            torch.nn.Dropout(args.dropout), torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = DataLoader(data.train, batch_size=32, shuffle=True)
model, optimizer, loader = ddtrain.prepare(model, optimizer, loader)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

state = ddtrain.load_state(args.checkpoint_dir)                     # added: None on the first run
trained, stopped = 0, False
for epoch in range(state.epoch if state else 0, args.epochs):       # changed: from the epoch in progress
    loader.set_epoch(epoch)
    for x, y in loader:                                             # a resumed epoch: only the batches left
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        trained += 1
        time.sleep(args.step_delay)
        if ddtrain.stop_requested():                                # added: a stop signal reached some rank
            ddtrain.save_state(args.checkpoint_dir)                 # added
            stopped = True
            break
    if stopped:
        break
    scheduler.step()
    ddtrain.print0(f"epoch {epoch + 1}: loss {loss.item():.4f}")

if args.out and ddtrain.rank() == 0:
    torch.save({"params": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "stopped": stopped,
                "batches_trained": trained, "steps": (state.step if state else 0) + trained,
                "resumed_from": None if state is None else [state.step, state.epoch, state.world_size_was],
                "rng_after": torch.rand(3)}, args.out)
ddtrain.shutdown()
