"""Issue 28's acceptance 3 and 4, recorded: a prepare() script stopped and resumed, and compressed runs resumed.

    PYTHONPATH=src python3 experiments/state_check.py --out results/state/acceptance.txt

Acceptance 4 (``ddtrain train``'s checkpoints): the runs of tests/reliability/test_compressor_resume.py
(MLP 1024-320-64-10, two DDP buckets, 11 steps, stopped at step 5 and resumed) for powersgd:2:2,
topk:0.1 and fp16 on 2 and 3 Gloo ranks, with the compressor state restored and with the restore
switched off (the behaviour before issue 28), and plain ddp without compression (no hook of ours):
the largest relative difference of the final parameters from the uninterrupted run.
Acceptance 3 (the state API): the runs of tests/integration/test_preemptible_script.py
(examples/preemptible.py under ``ddtrain run``, SIGTERM to the launcher in epoch 2, the same
command again; and with ``--global-batch-size 48`` run again on 3 workers).
"""
import argparse
import datetime
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "reliability"), str(REPO / "tests" / "integration")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import test_compressor_resume as compressed
    import test_preemptible_script as script
    lines = [f"# issue 28 acceptance 3 and 4; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
             f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores, "
             f"load average {os.getloadavg()[0]:.1f}",
             f"$ PYTHONPATH=src python3 experiments/state_check.py --out {args.out}", "",
             "# acceptance 4: ddtrain train --strategy ddp --compression C, stopped at step 5, resumed to step 11",
             "# largest relative difference of the final parameters from the uninterrupted run",
             f"{'compression':<14}{'ranks':>6}{'restored':>16}{'not restored':>16}"]
    for world in (2, 3):
        for spec in ("powersgd:2:2", "topk:0.1", "fp16", "none"):
            with tempfile.TemporaryDirectory() as tmp:
                kept = compressed.resumed_difference(Path(tmp), spec, world)
                lost = compressed.resumed_difference(Path(tmp), spec, world, restore=False) \
                    if spec not in ("fp16", "none") else float("nan")
            lines.append(f"{spec:<14}{world:>6}{kept:>16.3g}{lost:>16.3g}")
            print(lines[-1], flush=True)
    lines += ["# none: plain ddp, DDP's own all-reduce (no hook of ours: its first step after a restart sums",
              "# in another order on 3 ranks); nan: nothing kept between steps, nothing to switch off", ""]
    with tempfile.TemporaryDirectory() as tmp:
        same = script.same_size(Path(tmp))
    lines += ["# acceptance 3: examples/preemptible.py under ddtrain run --nproc 2 --checkpoint-dir D (--dropout 0.1),",
              "# SIGTERM to the launcher half a second into epoch 2, then the same command again"]
    lines += [f"same_size.{key}: {value}" for key, value in same.items()]
    print("\n".join(lines[-len(same):]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        grown = script.elastic(Path(tmp))
    lines += ["", "# ... with --global-batch-size 48 (no dropout): stopped on 2 workers, run again with --nproc 3,",
              "# against the uninterrupted 2-worker run"]
    lines += [f"elastic.{key}: {value}" for key, value in grown.items()]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(grown):]))


if __name__ == "__main__":
    main()
