#!/usr/bin/env bash
# Speed before and after a change, side by side in one run: benchmarks/loop_overhead.py (CPU
# seconds per step, ddtrain against a plain loop in the same process) and `ddtrain demo`, each
# from two checkouts in turn (before, after, before, after), so machine noise hits both alike.
#
#   bash benchmarks/before_after.sh /path/to/before-checkout OUT_DIR [ROUNDS]
#
# The "before" checkout is any git worktree of ddtrain (e.g. `git worktree add ../before REV`);
# each side runs from its own src/ via PYTHONPATH. Raw outputs land in OUT_DIR.
set -euo pipefail
before=$(cd "$1" && pwd); out=$2; rounds=${3:-2}
after=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    root=$([ "$side" = before ] && echo "$before" || echo "$after")
    echo "# round $round, $side ($(git -C "$root" rev-parse --short HEAD))" | tee -a "$out/loop_overhead_$side.txt"
    PYTHONPATH="$root/src" OMP_NUM_THREADS=1 python3 "$root/benchmarks/loop_overhead.py" --repeats 6 \
      | tee -a "$out/loop_overhead_$side.txt"
    echo "# round $round, $side ($(git -C "$root" rev-parse --short HEAD))" | tee -a "$out/demo_$side.txt"
    (cd "$(mktemp -d)" && PYTHONPATH="$root/src" python3 -m ddtrain demo --epochs 4) | tee -a "$out/demo_$side.txt"
  done
done
