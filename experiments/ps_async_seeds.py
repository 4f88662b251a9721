"""ps-async against ps-sync over 5 seeds, with the settings every other strategy trains well with (issue 21).

    python3 experiments/ps_async_seeds.py                       # writes results/ps_async/seeds.json
    python3 experiments/ps_async_seeds.py --seeds 0 1 --out /tmp/seeds.json
    python3 experiments/ps_async_seeds.py --variants "ps-async momentum" --out results/ps_async/momentum.json

MLP on the bundled 8x8 digits, 2 workers + 1 server (``ddtrain train --nproc 3``), lr 0.1,
batch 32, 4 epochs, momentum 0.9, staleness 4; by default ps-sync, ps-async with its default
rule and with ``--async-rule plain``; ``--variants`` picks others (each ``--async-rule``, VARIANTS). Each run's final
validation accuracy and ps-async's realised staleness histogram
go into one JSON file; a table goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SETTINGS = ["--nproc", "3", "--model", "mlp", "--data", "digits", "--lr", "0.1", "--batch-size", "32",
            "--epochs", "4", "--momentum", "0.9", "--staleness", "4", "--quiet"]
VARIANTS = {"ps-sync": ["--strategy", "ps-sync"],
            "ps-async": ["--strategy", "ps-async"],                       # whatever the default rule is
            # each rule named explicitly, so its file does not depend on the default (ALGORITHMS.md):
            "ps-async lr-staleness": ["--strategy", "ps-async", "--async-rule", "lr-staleness"],  # (a) lr/(1+s)
            "ps-async momentum": ["--strategy", "ps-async", "--async-rule", "momentum"],          # (b) momentum only
            "ps-async momentum-subtract": ["--strategy", "ps-async", "--async-rule", "momentum-subtract"],  # (b'') mu - mu_i only
            "ps-async lr-workers": ["--strategy", "ps-async", "--async-rule", "lr-workers"],      # (c) lr/M
            "ps-async staleness": ["--strategy", "ps-async", "--async-rule", "staleness"],        # (d) lr/(1+s), mu - mu_i
            "ps-async lr-staleness-momentum": ["--strategy", "ps-async", "--async-rule", "lr-staleness-momentum"],  # (a)+(b)
            "ps-async lr-workers-momentum": ["--strategy", "ps-async", "--async-rule", "lr-workers-momentum"],      # (c)+(b)
            "ps-async lr-staleness-no-momentum": ["--strategy", "ps-async", "--async-rule", "lr-staleness-no-momentum"],
            "ps-async dc-staleness": ["--strategy", "ps-async", "--async-rule", "dc-staleness"],
            "ps-async dc-lr-workers": ["--strategy", "ps-async", "--async-rule", "dc-lr-workers"],
            "ps-async dana": ["--strategy", "ps-async", "--async-rule", "dana"],
            "ps-async plain": ["--strategy", "ps-async", "--async-rule", "plain"]}
DEFAULT_VARIANTS = ["ps-sync", "ps-async", "ps-async plain"]


def run(variant: str, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "record.json")
        command = ["ddtrain", "train", *SETTINGS, *VARIANTS[variant], "--seed", str(seed), "--out", out]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            record = json.load(f)
    server = [c for c in record["comm"] if c.get("role") == "server"]
    return {"variant": variant, "seed": seed, "command": " ".join(command[:-2]),
            "val_accuracy": record["final"]["val_accuracy"],
            "val_accuracy_per_epoch": [e["val_accuracy"] for e in record["epochs"]],
            "staleness_histogram": server[0].get("staleness_histogram") if server else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--out", default="results/ps_async/seeds.json")
    args = parser.parse_args(argv)
    runs = [run(v, s) for v in args.variants for s in args.seeds]
    print("# final validation accuracy (MLP, digits, 2 workers + 1 server, lr 0.1, batch 32, 4 epochs, "
          "momentum 0.9, staleness 4)")
    print(f"# {'variant':<16}" + "".join(f"{'seed ' + str(s):>9}" for s in args.seeds) + f"{'median':>9}{'min':>9}")
    summary = {}
    for v in args.variants:
        accs = [r["val_accuracy"] for r in runs if r["variant"] == v]
        summary[v] = {"median": statistics.median(accs), "min": min(accs), "runs": len(accs),
                      "at_least_0.9": sum(a >= 0.9 for a in accs)}
        print(f"  {v:<16}" + "".join(f"{a:>9.3f}" for a in accs) + f"{summary[v]['median']:>9.3f}{min(accs):>9.3f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"settings": SETTINGS, "seeds": args.seeds, "summary": summary, "runs": runs,
                   "python": sys.version.split()[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
