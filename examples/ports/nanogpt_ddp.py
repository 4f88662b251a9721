"""nanoGPT's ``train.py`` (no DataLoader: random windows of a token stream per rank, gradient accumulation with
``require_backward_grad_sync``, AdamW, a cosine schedule set by hand, gradient clipping, bf16 autocast, evaluation and
checkpoints on the master process alone), in plain DDP.

    torchrun --nproc-per-node 2 examples/ports/nanogpt_ddp.py --out-dir /tmp/nanogpt
"""
import argparse
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GPTConfig, TinyGPT, cosine_with_warmup, token_stream


def main(argv=None):
    p = argparse.ArgumentParser(description="a tiny GPT on a synthetic token stream, nanoGPT's loop")
    p.add_argument("--max-iters", type=int, default=12)
    p.add_argument("--eval-interval", type=int, default=5)
    p.add_argument("--eval-iters", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--gradient-accumulation-steps", type=int, default=12)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--out-dir", default="")
    args = p.parse_args(argv)
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        ddp_rank, ddp_world_size = dist.get_rank(), dist.get_world_size()
        master_process = ddp_rank == 0
        seed_offset = ddp_rank
        assert args.gradient_accumulation_steps % ddp_world_size == 0
        args.gradient_accumulation_steps //= ddp_world_size
    else:
        master_process, seed_offset = True, 0
    torch.manual_seed(1337 + seed_offset)
    ctx = nullcontext() if args.dtype == "float32" else torch.autocast("cpu", dtype=torch.bfloat16)
    config = GPTConfig()
    data = token_stream()
    train_data, val_data = data[:5000], data[5000:]

    def get_batch(split):
        data = train_data if split == "train" else val_data
        ix = torch.randint(len(data) - config.block_size, (args.batch_size,))
        x = torch.stack([data[i:i + config.block_size] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + config.block_size] for i in ix])
        return x, y

    model = TinyGPT(config)
    optimizer = model.configure_optimizers(0.1, args.learning_rate, (0.9, 0.95))
    if args.compile:
        model = torch.compile(model)
    if ddp:
        model = DDP(model)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    X, Y = get_batch("train")
    iter_num, best_val_loss, history = 0, 1e9, []
    raw_model = model.module if ddp else model
    while True:
        lr = cosine_with_warmup(iter_num, 2, args.max_iters, args.learning_rate, args.learning_rate / 10)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0 and master_process:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            history.append({"iter": iter_num, **losses})
            if losses["val"] < best_val_loss and args.out_dir:
                best_val_loss = losses["val"]
                torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num,
                            "best_val_loss": best_val_loss}, os.path.join(args.out_dir, "ckpt.pt"))
        for micro_step in range(args.gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = (micro_step == args.gradient_accumulation_steps - 1)
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / args.gradient_accumulation_steps
            X, Y = get_batch("train")
            loss.backward()
        if args.grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if iter_num > args.max_iters:
            break
    return {"history": history, "state": raw_model.state_dict()}


if __name__ == "__main__":
    main()
    if int(os.environ.get("RANK", -1)) != -1:
        dist.destroy_process_group()
