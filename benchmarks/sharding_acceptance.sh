#!/usr/bin/env bash
# The sharding acceptance runs on CPU (docs/SHARDING.md): 3 ranks, ddp vs zero1/zero2/fsdp, AdamW and SGD+momentum,
# 40 steps; and a zero2 run checkpointed on 2 workers and resumed on 3 against the uninterrupted run.
# Usage (from the repository root): PYTHONPATH=src bash benchmarks/sharding_acceptance.sh results/sharding
set -euo pipefail
out=${1:-results/sharding}
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--model mlp --data digits --steps 40 --batch-size 16 --quiet --val-fraction 0)
for opt in adamw sgd; do
  extra=(--optimizer "$opt" --lr 0.01)
  [ "$opt" = sgd ] && extra=(--optimizer sgd --lr 0.05 --momentum 0.9)
  for s in ddp zero1 zero2 ${STRATEGIES_EXTRA:-}; do
    python -m ddtrain train --nproc 3 --strategy "$s" "${common[@]}" "${extra[@]}" \
      --out "$out/${s}_${opt}.json" --save "$tmp/${s}_${opt}.pt" 2>/dev/null
  done
done
# elastic: zero2 on 2 workers to step 20, resumed on 3 to step 40; the uninterrupted run on 2 workers
el=(--strategy zero2 --model mlp --data digits --global-batch-size 48 --optimizer adamw --lr 0.01 --quiet --val-fraction 0)
python -m ddtrain train --nproc 2 "${el[@]}" --steps 40 --out "$out/elastic_uninterrupted.json" \
  --save "$tmp/elastic_uninterrupted.pt" 2>/dev/null
python -m ddtrain train --nproc 2 "${el[@]}" --steps 20 --checkpoint-dir "$tmp/ck" --out "$out/elastic_first.json" 2>/dev/null
python -m ddtrain train --nproc 3 "${el[@]}" --steps 40 --checkpoint-dir "$tmp/ck" --resume \
  --out "$out/elastic_resumed.json" --save "$tmp/elastic_resumed.pt" 2>/dev/null
python benchmarks/sharding_compare.py "$tmp" "$out" | tee "$out/acceptance.txt"
