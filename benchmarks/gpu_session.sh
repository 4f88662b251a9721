#!/usr/bin/env bash
# The device calls, scripted (results under OUTDIR):
#   bash benchmarks/gpu_session.sh a OUTDIR   CUDA tests, collectives over every GPU, one-GPU eager speed
#   bash benchmarks/gpu_session.sh b OUTDIR   scaling on 1..N GPUs, one-GPU eager and compiled speed
set -uo pipefail
part=${1:-a}; out=${2:-results/gpu}; mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared multi-GPU hosts (device tool's KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi -L; python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
workers=$(python3 -c "print(','.join(str(2**i) for i in range(8) if 2**i <= $ngpu))")
if [ "$part" = a ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -5
  python3 -m ddtrain bench collectives --algorithms native,ring,ring-async,tree,butterfly,central \
      --sizes 8:1G --nproc "$ngpu" --json "$out/collectives_${ngpu}gpu.json" 2>&1 | tee "$out/collectives_${ngpu}gpu.txt" | tail -45
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/gpu_single.py --cases "resnet50 fp32,resnet50 bf16 cl,resnet18 bf16 cl,unet 97ch 192 bf16" \
      --strategies "${STRATEGIES:-ddp,ring}" --repeats 2 --out "$out/gpu_single_eager.json" 2>&1 | tail -14
else
  unet_scaling() {  # document 000 Table 7.3's shape: U-Net training time against batch size per setup
    timeout 240 python3 -m ddtrain bench scaling --model unet --data synthetic:hcp --data-arg samples=600 \
        --strategies ddp --workers "$workers" --batch-sizes 10,30,60 --amp bf16 --channels-last --steps 20 \
        --warmup-steps 5 --no-monitor --out "$out/scaling_unet" > "$out/scaling_unet.txt" 2>&1; tail -22 "$out/scaling_unet.txt"
  }
  timeout 300 python3 -m ddtrain bench scaling --model resnet50 --data synthetic:imagenet --data-arg samples=512 \
      --data-arg lazy=false --strategies ddp,ring,hybrid,local-sgd --workers "$workers" --batch-sizes 256 \
      --amp bf16 --channels-last --steps 30 --warmup-steps 10 --sync-every 10 --no-monitor \
      --out "$out/scaling_resnet50" > "$out/scaling_resnet50.txt" 2>&1; tail -30 "$out/scaling_resnet50.txt"
  [ "${SCALING_ONLY:-0}" = 1 ] && { unet_scaling; exit 0; }
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/gpu_single.py --cases "resnet50 bf16 cl,resnet18 bf16 cl,unet 97ch 192 bf16" \
      --strategies ddp,ring --repeats 2 --out "$out/gpu_single_eager.json" 2>&1 | tail -9
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/gpu_single.py --cases "resnet50 bf16 cl compile" \
      --strategies ddp,ring --repeats 1 --out "$out/gpu_single_compile.json" 2>&1 | tail -4
fi
