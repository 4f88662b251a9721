"""``ddtrain checkpoint info DIR_OR_FILE``: a checkpoint's step, configuration, size, resumable worker counts and integrity.

    ddtrain checkpoint info runs/ckpt                  # every checkpoint of the directory, newest first
    ddtrain checkpoint info runs/ckpt/ckpt-00000030.pt

Exits 1 when a file is damaged (the line says what is wrong), 0 when every file is whole. A file
that a run rotated away while the directory was read is named as gone (not damaged).
"""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="a checkpoint directory (--checkpoint-dir) or one ckpt-NNNNNNNN.pt file")


def main(args) -> int:
    from ddtrain.reliability.checkpoint_info import inspect, lines
    found = inspect(args.target)
    for i, info in enumerate(found):
        if i:
            print()
        print("\n".join(lines(info)))
    damaged = [info.path.name for info in found if info.problem is not None]
    gone = [info.path.name for info in found if info.gone]
    if len(found) > 1:
        whole = [info.path.name for info in found if info.problem is None and not info.gone]
        print(f"\n# {len(found)} checkpoints, newest whole: {whole[0] if whole else 'none'}"
              + (f"; damaged: {', '.join(damaged)}" if damaged else "")
              + (f"; gone while read (rotated): {', '.join(gone)}" if gone else ""))
    return 1 if damaged else 0
