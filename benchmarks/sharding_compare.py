"""Compare the saved models and read the memory of the records written by benchmarks/sharding_acceptance.sh.

Relative difference of two models: ||a - b|| / ||b|| over all parameters (2-norms of the flattened
parameters), and the largest per-tensor max|a - b| / max|b|. Memory: each record's per-rank bytes
(sync.memory) as a fraction of ddp's. Usage: python benchmarks/sharding_compare.py MODELS_DIR RECORDS_DIR
"""
import json
import sys
from pathlib import Path

import torch


def load(path):
    state = torch.load(path, map_location="cpu")
    return state.get("model", state) if isinstance(state, dict) else state


def relative(a, b):
    diff = sum(float((a[k].double() - b[k].double()).square().sum()) for k in b) ** 0.5
    norm = sum(float(b[k].double().square().sum()) for k in b) ** 0.5
    worst = max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b)
    return diff / norm, worst


def main(models, records):
    models, records = Path(models), Path(records)
    print("# model      strategy  norm_rel   max_rel    param_x  grad_x  optstate_x   (x: worst rank's bytes / ddp's)")
    for opt in ("adamw", "sgd"):
        ddp = load(models / f"ddp_{opt}.pt")
        base = json.loads((records / f"ddp_{opt}.json").read_text())["comm"][0]["memory"]
        for path in sorted(models.glob(f"*_{opt}.pt")):
            strategy = path.stem.rsplit("_", 1)[0]
            if strategy == "ddp":
                continue
            norm_rel, max_rel = relative(load(path), ddp)
            mem = [c["memory"] for c in json.loads((records / f"{strategy}_{opt}.json").read_text())["comm"]]
            ratio = {k: max(m[k] for m in mem) / base[k] for k in ("parameter_bytes", "gradient_bytes",
                                                                   "optimizer_state_bytes")}
            print(f"  {opt:<10} {strategy:<9} {norm_rel:.2e}  {max_rel:.2e}  {ratio['parameter_bytes']:7.3f}  "
                  f"{ratio['gradient_bytes']:6.3f}  {ratio['optimizer_state_bytes']:10.3f}")
    norm_rel, max_rel = relative(load(models / "elastic_resumed.pt"), load(models / "elastic_uninterrupted.pt"))
    print(f"# elastic zero2 2 -> 3 workers at step 20 vs uninterrupted (40 steps): norm_rel {norm_rel:.2e} "
          f"max_rel {max_rel:.2e}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
