#!/usr/bin/env bash
# Parameter servers on NCCL (ResNet-50 scaling cells), after the peer pre-connection fix:
#   bash experiments/gpu_ps_check.sh OUTDIR [STRATEGY] [SERVERS]   (default ps-sync, 1 server: 1..N-1 workers)
set -uo pipefail
out=${1:-/tmp/r}; strategy=${2:-ps-sync}; servers=${3:-1}; mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=WARN
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
ps_workers=$(python3 -c "print(','.join(str(w) for w in range(1, $ngpu - $servers + 1)))")
name=scaling_resnet50_${strategy//-/_}_s${servers}
timeout 300 python3 -m ddtrain bench scaling --model resnet50 --data synthetic:imagenet \
    --data-arg samples=$((256 * 41 * ngpu)) --data-arg lazy=true --strategies "$strategy" --servers "$servers" --workers "$ps_workers" \
    --batch-sizes 256 --amp bf16 --channels-last --steps 30 --warmup-steps 10 --sync-every 10 --no-monitor \
    --timeout 40 --cell-timeout 80 --out "$out/$name" > "$out/$name.txt" 2>&1
grep -v "^\[rank" "$out/$name.txt" | tail -22
for f in "$out"/$name/cells/*.log; do grep -q "FAILED\|error" "$f" && { echo "== $f"; grep -v Warning "$f" | grep -i "nccl warn\|error\|#[0-9]" | head -25; }; done
