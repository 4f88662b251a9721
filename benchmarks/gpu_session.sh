#!/usr/bin/env bash
# The device calls, scripted (results under OUTDIR); each part fits one 10-minute call:
#   bash benchmarks/gpu_session.sh one OUTDIR      CUDA tests; one GPU: eager speed against the plain loop, data paths
#   bash benchmarks/gpu_session.sh compile OUTDIR  one GPU: ResNet-50 compiled against the plain loop, kernel profile
#   bash benchmarks/gpu_session.sh multi1 OUTDIR   every GPU: collectives 8 B..4 GiB; ResNet-50 scaling (ddp, ring, hybrid, local-sgd)
#   bash benchmarks/gpu_session.sh multi2 OUTDIR   every GPU: ResNet-50 ps-sync; U-Net over batch sizes; ddtrain report over OUTDIR
set -uo pipefail
part=${1:-one}; out=${2:-results/gpu}; mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
# NVLink multicast stays off on shared multi-GPU hosts (device tool's KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi -L; python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
workers=$(python3 -c "print(','.join(str(2**i) for i in range(8) if 2**i <= $ngpu))")
ps_workers=$(python3 -c "print(','.join(str(w) for w in range(1, $ngpu)) or '')")  # + 1 server rank = ngpu
# ResNet-50 scaling data: one epoch holds every timed step of the largest cell (no epoch end in the window),
# computed on each GPU once (synthetic, lazy on the host, materialised on the device).
r50_samples=$((256 * 41 * ngpu))
scaling() {  # name, strategies, workers, extra args...
  local name=$1 strategies=$2 w=$3; shift 3
  timeout 420 python3 -m ddtrain bench scaling --model resnet50 --data synthetic:imagenet \
      --data-arg samples=$r50_samples --data-arg lazy=true --strategies "$strategies" --workers "$w" --batch-sizes 256 \
      --amp bf16 --channels-last --steps 30 --warmup-steps 10 --sync-every 10 --no-monitor --cell-timeout 150 \
      --out "$out/$name" "$@" > "$out/$name.txt" 2>&1; tail -32 "$out/$name.txt"
}
case "$part" in
one)
  python3 -m pytest -q -p no:cacheprovider tests/integration/test_cuda.py 2>&1 | tail -4
  CUDA_VISIBLE_DEVICES=0 timeout 480 python3 benchmarks/gpu_single.py \
      --cases "resnet50 fp32,resnet50 bf16 cl,resnet18 bf16 cl,unet 97ch 192 bf16" \
      --strategies ddp,ring --repeats 2 --out "$out/gpu_single_eager.json" 2>&1 | tail -16 ;;
compile)
  CUDA_VISIBLE_DEVICES=0 timeout 540 python3 benchmarks/gpu_single.py --cases "resnet50 bf16 cl compile" \
      --profile "resnet50 bf16 cl compile" --strategies ddp,ring --repeats 2 \
      --out "$out/gpu_single_compile.json" 2>&1 | tail -40 ;;
multi1)
  nvidia-smi topo -m | head -12
  timeout 240 python3 -m ddtrain bench collectives --algorithms native,ring,ring-async,tree,butterfly,central \
      --sizes 8:4G --nproc "$ngpu" --json "$out/collectives_${ngpu}gpu.json" > "$out/collectives_${ngpu}gpu.txt" 2>&1
  grep -v "Warning" "$out/collectives_${ngpu}gpu.txt" | tail -60
  scaling scaling_resnet50 ddp,ring,hybrid,local-sgd "$workers" ;;
multi2)
  [ -n "$ps_workers" ] && scaling scaling_resnet50_ps ps-sync "$ps_workers" --timeout 60 --cell-timeout 100
  timeout 300 python3 -m ddtrain bench scaling --model unet --data synthetic:hcp --data-arg samples=1920 \
      --data-arg lazy=true --strategies ddp --workers "$workers" --batch-sizes 10,30,60 --amp bf16 --channels-last \
      --steps 20 --warmup-steps 5 --no-monitor --cell-timeout 120 --out "$out/scaling_unet" > "$out/scaling_unet.txt" 2>&1
  tail -24 "$out/scaling_unet.txt"
  python3 -m ddtrain report "$out" --title "ddtrain on $ngpu GPUs" 2>&1 | tail -5 ;;
*) echo "unknown part $part (one, compile, multi1, multi2)" >&2; exit 2 ;;
esac
