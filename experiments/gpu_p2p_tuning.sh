#!/usr/bin/env bash
# Our ring against NCCL's all-reduce under NCCL point-to-point settings (one bench per setting).
set -uo pipefail
out=${1:-/tmp/r}; mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
for setting in "default" "NCCL_P2P_NVL_CHUNKSIZE=2097152" "NCCL_MIN_P2P_NCHANNELS=32" \
               "NCCL_P2P_NVL_CHUNKSIZE=2097152 NCCL_MIN_P2P_NCHANNELS=32 NCCL_BUFFSIZE=16777216"; do
  name=$(echo "$setting" | tr ' =' '_-')
  env $( [ "$setting" = default ] || echo "$setting" ) timeout 120 python3 -m ddtrain bench collectives \
      --algorithms native,ring,butterfly --sizes 16M:1G --nproc "$ngpu" --json "$out/p2p_$name.json" > "$out/p2p_$name.txt" 2>&1
  echo "== $setting"; grep -E "busbw / native busbw|Avg bus bandwidth" "$out/p2p_$name.txt"
  grep -E "^ +[0-9]+ +[0-9]+ +float32 +native" "$out/p2p_$name.txt" | awk '{printf "native busbw %s: %s GB/s\n", $1, $7}' | tail -3
done
