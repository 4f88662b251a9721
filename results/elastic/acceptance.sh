#!/bin/bash
# Acceptance 1 of issue 18: --global-batch-size 96, 2 workers train 30 steps (checkpoint), then 3 and 4
# workers resume from that one checkpoint to step 60; each --save file is compared with the
# uninterrupted 2-worker 60-step run. ps-sync runs one server rank besides the workers.
# usage: bash results/elastic/acceptance.sh OUT_DIR  (prints one line per strategy x size)
set -u
out=${1:-/tmp/elastic-acceptance}; rm -rf "$out"; mkdir -p "$out"
common=(--model mlp --data digits --global-batch-size 96 --seed 1 --lr 0.05 --momentum 0.9 --quiet)
for strategy in ddp ring tree ps-sync; do
  extra=0; [ "$strategy" = ps-sync ] && extra=1
  d="$out/$strategy"; mkdir -p "$d"
  python3 -m ddtrain train "${common[@]}" --strategy $strategy --nproc $((2+extra)) --steps 60 --save "$d/ref.pt" >"$d/ref.log" 2>&1 || { echo "$strategy ref failed"; cat "$d/ref.log"; }
  python3 -m ddtrain train "${common[@]}" --strategy $strategy --nproc $((2+extra)) --steps 30 --checkpoint-dir "$d/ckpt" >"$d/first.log" 2>&1 || { echo "$strategy first failed"; cat "$d/first.log"; }
  for w in 3 4; do
    cp -r "$d/ckpt" "$d/ckpt$w"
    python3 -m ddtrain train "${common[@]}" --strategy $strategy --nproc $((w+extra)) --steps 60 --checkpoint-dir "$d/ckpt$w" --resume --save "$d/r$w.pt" >"$d/r$w.log" 2>&1 || { echo "$strategy $w failed"; cat "$d/r$w.log"; }
    grep -h "resume at another world size" "$d/r$w.log"
    python3 - "$d/ref.pt" "$d/r$w.pt" "$strategy" "$w" <<'PY'
import sys, torch
ref, got = (torch.load(p, map_location="cpu", weights_only=True) for p in sys.argv[1:3])
worst = max(((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item() for k, v in ref.items())
print(f"{sys.argv[3]:8s} 2 -> {sys.argv[4]} workers: max relative difference to the uninterrupted 2-worker run "
      f"{worst:.3e} over {len(ref)} tensors: {'EQUAL (rtol 1e-5)' if worst <= 1e-5 else 'DIFFERENT'}")
PY
  done
done
