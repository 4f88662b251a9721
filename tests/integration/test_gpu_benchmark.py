"""benchmarks/gpu_single.py runs end to end on the CPU (--quick), and its kernel classes are sane.

The numbers it exists for come from the GPU machine (docs/PERFORMANCE.md, "One GPU"); this only
keeps the script from breaking where CI can see it.
"""
import json
import os
import subprocess
import sys
from helpers import REPO

BENCH = REPO / "benchmarks"


def test_gpu_single_quick_runs_and_records_ratios(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_single.py"), "--quick", "--cases", "resnet18 bf16 cl",
                           "--strategies", "ddp", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    (case,) = record["cases"]
    assert case["case"] == "resnet18 bf16 cl" and case["images_per_s"]["plain"] > 0
    assert abs(case["ratio"]["ddp"] - case["images_per_s"]["ddp"] / case["images_per_s"]["plain"]) < 1e-9
    assert "ratio to the plain loop" in proc.stdout


def test_kernel_kinds():
    sys.path.insert(0, str(BENCH))
    from gpu_probe import kind_of
    assert kind_of("triton_poi_fused__native_batch_norm_legit_functional_add_convolution_backward_1") == "fused (Triton)"
    assert kind_of("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc") == "convolution"
    assert kind_of("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert kind_of("void at::native::multi_tensor_apply_kernel<...>") == "optimizer"
    assert kind_of("Memcpy HtoD (Pinned -> Device)") == "copies"
