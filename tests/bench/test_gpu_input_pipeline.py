"""benchmarks/gpu_input_pipeline.py (issue 30's device run): its CPU-independent parts, and a CPU smoke run.

The numbers come from the GPU machine; this keeps the script from breaking where CI sees it:
the command lines it builds, how a failing or hanging variant is recorded without stopping the
others, the ratios, and one quick run on the CPU (where the plain loop fails: no torchvision).
"""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_input_pipeline as bench

S = {"model": "resnet50", "size": 224, "batch": 256, "steps": 40, "warmup": 10, "workers": 15, "amp": "bf16",
     "channels_last": True, "images": 10000, "classes": 100}


def test_ddtrain_command_lines():
    argv = bench.ddtrain_command("ddtrain-folder-cpu-eager", "imagefolder:/d", S, "/o.json")
    text = " ".join(argv[1:])
    assert text.startswith("-m ddtrain train --model resnet50 --data imagefolder:/d --data-arg size=224")
    for flag in ("--steps 50", "--profile-warmup-steps 10", "--amp bf16", "--channels-last", "--loader-workers 15",
                 "--data-arg pipeline=cpu", "--val-fraction 0", "--out /o.json"):
        assert flag in text
    assert "--compile" not in text
    assert "--compile" in bench.ddtrain_command("ddtrain-packed-compiled", "packed:/p", S, "/o.json")
    tuned = " ".join(bench.ddtrain_command("compile-tuned-cold", "packed:/p", S, "/o.json"))
    assert "--data synthetic:imagenet" in tuned and "--compile --compile-options tuned-graphs" in tuned
    bench_argv = " ".join(bench.ddtrain_command("bench-packed", "packed:/p", S, "/o.json"))
    assert "bench data --data packed:/p" in bench_argv and "--steps 40 --warmup 10" in bench_argv


def test_a_failing_or_hanging_variant_is_recorded_not_raised(tmp_path):
    paths = {"folder": tmp_path / "jpeg", "packed": tmp_path / "packed"}

    def hangs(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"], output="Epoch 1/1: compiling the model...\n")

    def fails(argv, **kw):
        return SimpleNamespace(returncode=2, stdout="", stderr="ddtrain: error: packed: shard x fails its checksum\n")

    late = bench.run_variant("ddtrain-packed-compiled", paths, S, tmp_path, 5, {}, runner=hangs)
    assert not late["ok"] and late["error"] == "timed out after 5 s" and "compiling" in late["tail"][0]
    bad = bench.run_variant("ddtrain-packed-eager", paths, S, tmp_path, 5, {}, runner=fails)
    assert not bad["ok"] and bad["error"] == "exit 2: ddtrain: error: packed: shard x fails its checksum"


def test_ratios_are_to_the_plain_loop_of_the_same_mode():
    results = {"plain-eager": {"ok": True, "images_per_s": 2000.0}, "plain-compiled": {"ok": True, "images_per_s": 2500.0},
               "ddtrain-folder-eager": {"ok": True, "images_per_s": 3000.0},
               "ddtrain-packed-compiled": {"ok": True, "images_per_s": 5000.0},
               "bench-folder": {"ok": True, "images_per_s": 9000.0}, "ddtrain-folder-cpu-eager": {"ok": False},
               "compile-tuned-warm": {"ok": True, "images_per_s": 7000.0}}
    assert bench.ratios(results) == {"plain-eager": 1.0, "plain-compiled": 1.0, "ddtrain-folder-eager": 1.5,
                                     "ddtrain-packed-compiled": 2.0, "bench-folder": 4.5}


@pytest.mark.slow   # makes a folder, packs it and launches three processes: ~20 s here
def test_quick_run_on_the_cpu(tmp_path):
    out = tmp_path / "q.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_input_pipeline.py"), "--quick", "--out",
                           str(out), "--variants", "plain-eager,ddtrain-packed-eager,bench-packed"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    variants = record["variants"]
    assert not variants["plain-eager"]["ok"]                      # no torchvision on this machine: reported
    assert variants["ddtrain-packed-eager"]["ok"] and variants["ddtrain-packed-eager"]["images_per_s"] > 0
    assert variants["bench-packed"]["ok"] and "steady step" in variants["ddtrain-packed-eager"]["steady"]
    assert "images/s" in proc.stdout and record["ratio_to_plain"] == {}
