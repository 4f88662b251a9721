"""A Hugging Face ``run_glue_no_trainer.py``-style loop (dict batches, AdamW without decay on biases and LayerNorm,
a linear warm-up schedule sized from the loader, gradient accumulation, evaluation every N steps with predictions
gathered across ranks, the final model saved after a barrier), ported to ddtrain.

    python examples/ports/hf_no_trainer_ddtrain.py
    torchrun --nproc-per-node 2 examples/ports/hf_no_trainer_ddtrain.py --eval-steps 5 --output-dir /tmp/hf
    ddtrain run --nproc 3 --strategy ps-async examples/ports/hf_no_trainer_ddtrain.py
"""
import argparse
import functools
import math
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

import ddtrain

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import TinyClassifier, linear_schedule_with_warmup, token_classification


def evaluate(model, eval_dataloader):
    """Accuracy over the evaluation set: predictions gathered from every rank, the sampler's repeats left out."""
    model.eval()
    correct = seen = 0
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        predictions, references = ddtrain.gather_for_metrics((outputs.logits.argmax(dim=-1), batch["labels"]))
        seen += len(references)
        correct += (predictions == references).sum().item()
    model.train()
    return correct / seen


def main(argv=None):
    p = argparse.ArgumentParser(description="sequence classification, Hugging Face no-trainer style")
    p.add_argument("--per-device-train-batch-size", type=int, default=8)
    p.add_argument("--per-device-eval-batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--num-train-epochs", type=int, default=2)
    p.add_argument("--gradient-accumulation-steps", type=int, default=2)
    p.add_argument("--num-warmup-steps", type=int, default=3)
    p.add_argument("--eval-steps", type=int, default=4, help="evaluate every N optimizer steps (0: each epoch's end)")
    p.add_argument("--train-samples", type=int, default=301)
    p.add_argument("--eval-samples", type=int, default=101)
    p.add_argument("--output-dir", default="")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--strategy", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    train_dataset, eval_dataset = token_classification(args.train_samples, args.eval_samples)
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, batch_size=args.per_device_eval_batch_size)
    model = TinyClassifier()
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
    model, optimizer, train_dataloader, eval_dataloader = ddtrain.prepare(
        model, optimizer, train_dataloader, eval_dataloader, strategy=args.strategy, seed=args.seed)
    # after prepare: len(train_dataloader) is this rank's share, as the twin's DistributedSampler loader's
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = LambdaLR(optimizer, functools.partial(linear_schedule_with_warmup, num_warmup_steps=args.num_warmup_steps,
                                                         num_training_steps=max_train_steps))
    completed_steps, history = 0, []
    for epoch in range(args.num_train_epochs):
        model.train()
        train_dataloader.sampler.set_epoch(epoch)
        for step, batch in enumerate(train_dataloader):
            sync = (step + 1) % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1
            with nullcontext() if sync else model.no_sync():
                outputs = model(**batch)
                (outputs.loss / args.gradient_accumulation_steps).backward()
            if sync:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
                if args.eval_steps and completed_steps % args.eval_steps == 0:
                    history.append({"step": completed_steps, "accuracy": evaluate(model, eval_dataloader)})
            if completed_steps >= max_train_steps:
                break
        accuracy = evaluate(model, eval_dataloader)
        history.append({"epoch": epoch, "accuracy": accuracy, "lr": lr_scheduler.get_last_lr()[0]})
        if ddtrain.rank() == 0:
            print(f"epoch {epoch}: accuracy {accuracy:.4f}")
    if ddtrain.is_distributed():
        dist.barrier(group=ddtrain.worker_group())
    if ddtrain.rank() == 0 and args.output_dir:
        torch.save(model.module.state_dict(), os.path.join(args.output_dir, "pytorch_model.bin"))
    return {"history": history, "state": model.module.state_dict()}


if __name__ == "__main__":
    main()
    ddtrain.shutdown()
