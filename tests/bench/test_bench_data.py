"""``ddtrain bench data``: the input pipeline alone, images/s and the settings in a JSON (issue 30)."""
import json
import sys

import numpy as np
import pytest
from PIL import Image

from ddtrain.bench.data import DataBenchConfig, run, table
from ddtrain.errors import DDTrainError
from helpers import ddtrain


@pytest.fixture
def jpegs(tmp_path):
    root = tmp_path / "jpegs"
    rng = np.random.default_rng(0)
    for k in range(3):
        (root / f"c{k}").mkdir(parents=True)
        for j in range(8):
            Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(root / f"c{k}" / f"{j}.jpg")
    return root


def test_counts_the_timed_batches_across_epochs_and_compares_specs(jpegs, tmp_path):
    from ddtrain.data.packed import PackOptions, pack
    pack(str(jpegs), str(tmp_path / "packed"), PackOptions(max_side=0), workers=1)
    config = DataBenchConfig(data=[f"imagefolder:{jpegs}", f"packed:{tmp_path / 'packed'}"],
                             data_args={"size": 32}, batch_size=5, steps=7, warmup=2, repeats=2)
    lines = []
    result = run(config, progress=lines.append)
    first, second = result["rows"]
    # 24 images in batches of 5: 5 batches an epoch (the last of 4), so 9 batches span two epochs
    for row in result["rows"]:
        assert len(row["runs"]) == 2 and all(r["batches"] == 7 and r["epochs_started"] == 2 for r in row["runs"])
        assert all(30 <= r["images"] <= 35 and r["batch_shape"][1:] == [3, 32, 32] for r in row["runs"])
        assert row["images_per_s"] == np.median(row["all_images_per_s"]) > 0
        if pytest.importorskip("psutil"):   # CPU of this process (no loader processes here), per image
            assert all(r["cpu_s"] >= 0 and r["cpu_ms_per_image"] == pytest.approx(1e3 * r["cpu_s"] / r["images"])
                       for r in row["runs"])
    assert result["images_per_s"] == first["images_per_s"] and first["ratio_to_first"] == 1.0
    assert second["ratio_to_first"] == pytest.approx(second["images_per_s"] / first["images_per_s"])
    assert first["data_pipeline"]["decoder"] == "pillow" and second["data_pipeline"]["decoder"] == "none (raw pixels)"
    assert result["settings"]["device"] == "cpu" and result["host"]["cpus"] >= 1
    text = "\n".join(table(result))
    assert "images/s" in text and f"packed:{tmp_path / 'packed'}" in text and len(lines) == 4


def test_bench_data_command_writes_images_per_s(jpegs, tmp_path):
    out = tmp_path / "data.json"
    result = ddtrain("bench", "data", "--data", f"imagefolder:{jpegs}", "--data-arg", "size=32", "--batch-size", "6",
                     "--steps", "3", "--warmup", "1", "--loader-workers", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["images_per_s"] > 0 and record["settings"]["loader_workers"] == 1
    assert "# bench data: batch 6, 1 loader workers" in result.stdout


def test_cpu_clock_counts_the_window_of_children_alive_and_ended():
    """A child that burned 0.3 s before the window counts only its CPU inside it; one started and ended inside, all."""
    pytest.importorskip("psutil")
    import subprocess
    import time

    from ddtrain.bench.data import CpuClock
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}: pass\n"
    early = subprocess.Popen([sys.executable, "-c", burn.format(0.3) + "import sys\nsys.stdin.read()\n" + burn.format(0.3)],
                             stdin=subprocess.PIPE)
    import psutil
    while sum(psutil.Process(early.pid).cpu_times()[:2]) < 0.3:    # its first 0.3 s: before the window
        time.sleep(0.02)
    clock = CpuClock()
    clock.start()
    subprocess.run([sys.executable, "-c", burn.format(0.4)], check=True)   # inside the window, reaped
    early.communicate(b"")                                                # burns 0.3 s more, then ends
    cpu = clock.stop()
    assert 0.7 <= cpu < 0.95, cpu       # 0.4 + 0.3, one interpreter's start-up; not the 0.3 s before the window


def test_uint8_stops_at_the_batch_a_gpu_would_receive(jpegs):
    config = DataBenchConfig(data=[f"imagefolder:{jpegs}"], data_args={"size": 32}, batch_size=4, steps=2, warmup=1,
                             uint8=True)
    (row,) = run(config, progress=lambda line: None)["rows"]
    assert {r["dtype"] for r in row["runs"]} == {"uint8"} and row["runs"][0]["batch_shape"] == [4, 3, 32, 32]
    assert run(DataBenchConfig(data=[f"imagefolder:{jpegs}"], data_args={"size": 32}, batch_size=4, steps=2, warmup=1),
               progress=lambda line: None)["rows"][0]["runs"][0]["dtype"] == "float32"


def test_bad_settings_are_refused():
    with pytest.raises(DDTrainError, match="--steps must be at least 1"):
        run(DataBenchConfig(data=["digits"], steps=0))
    with pytest.raises(DDTrainError, match="--device 'tpu'"):
        run(DataBenchConfig(data=["digits"], device="tpu"))
