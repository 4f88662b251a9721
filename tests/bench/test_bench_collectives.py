"""``ddtrain bench collectives``: sizes, the exact reference, the #wrong check, and a real CLI run."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ddtrain.bench.collectives import BenchConfig, pattern, parse_size, parse_sizes
from ddtrain.bench.collectives import COLUMNS
from ddtrain.errors import DDTrainError
from multirank import run_ranks


def test_sizes_double_from_min_to_max_with_binary_suffixes():
    assert parse_size("64") == 64 and parse_size("1K") == 1024 and parse_size("64M") == 64 << 20
    assert parse_size("2kb") == 2048 and parse_size("1G") == 1 << 30
    assert parse_sizes("1K:8K", 4) == [1024, 2048, 4096, 8192]
    assert parse_sizes("1K:64M", 4)[-1] == 64 << 20 and len(parse_sizes("1K:64M", 4)) == 17
    assert parse_sizes("6:48", 4) == [4, 12, 24, 48]          # rounded down to whole elements
    assert parse_sizes("16", 8) == [16]


@pytest.mark.parametrize("bad", ["", "1X", "K", "-1", "1.5M"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(DDTrainError, match="bad size"):
        parse_size(bad)


def test_size_ranges_are_checked():
    with pytest.raises(DDTrainError, match="MAX"):
        parse_sizes("8K:1K", 4)
    with pytest.raises(DDTrainError, match="one element"):
        parse_sizes("2:8", 4)


def test_config_is_checked():
    with pytest.raises(DDTrainError, match="valid: avg, max, min, sum"):
        BenchConfig(algorithms=["ring"], sizes=[8], op="prod")
    with pytest.raises(DDTrainError, match="floating-point"):
        BenchConfig(algorithms=["ring"], sizes=[8], dtype="int32", op="avg")
    with pytest.raises(DDTrainError, match="--min-iters"):
        BenchConfig(algorithms=["ring"], sizes=[8], iters=2, min_iters=3)


@pytest.mark.parametrize("op, dtype", [(op, dtype) for op in ("sum", "avg", "max", "min")
                                       for dtype in (torch.float32, torch.bfloat16, torch.int8)
                                       if op != "avg" or dtype.is_floating_point])
def test_the_reference_is_the_single_process_reduction_of_every_ranks_input(op, dtype):
    ranks, count = 5, 31
    inputs = [pattern(r, count, dtype, ranks, op, torch.device("cpu"))[0] for r in range(ranks)]
    stacked = torch.stack([x.double() for x in inputs])
    want = {"sum": stacked.sum(0), "avg": stacked.sum(0) / ranks, "max": stacked.max(0).values,
            "min": stacked.min(0).values}[op]
    expected = pattern(0, count, dtype, ranks, op, torch.device("cpu"))[1]
    assert expected.dtype == dtype
    assert torch.equal(expected, want.to(dtype))
    assert len(set(inputs[0].tolist())) > 1 and not torch.equal(inputs[0], inputs[1])


def _bench_on_ranks(algorithms, sizes, op):
    from ddtrain.bench.collectives import run_bench
    config = BenchConfig(algorithms=algorithms, sizes=sizes, op=op, iters=3, min_iters=2, warmup=1,
                         budget_s=0.02, calibrate=False)
    return run_bench(config)["rows"]


def test_every_algorithm_passes_the_check():
    from ddtrain.comm import ALGORITHMS
    results = run_ranks(_bench_on_ranks, 2, list(ALGORITHMS), [4, 12, 100, 4096], "max")
    rows = results[0]
    assert len(rows) == 4 * len(ALGORITHMS)
    assert [r["wrong"] for r in rows] == [0] * len(rows)
    assert all(r["time_us"] > 0 and r["iters"] >= 2 for r in rows)
    assert results[1] == rows   # every rank returns the same table


def _count_wrong_of_a_broken_reduction():
    """An 'all-reduce' that forgets to reduce must be caught by the checker."""
    from ddtrain.bench.collectives import time_calls
    import torch.distributed as dist
    config = BenchConfig(algorithms=["ring"], sizes=[40], iters=2, min_iters=1, warmup=1, budget_s=0.01)
    inputs, expected = pattern(dist.get_rank(), 10, torch.float32, 2, "sum", torch.device("cpu"))
    return time_calls(lambda work: None, inputs, expected, config, None, torch.device("cpu")).wrong


def test_wrong_results_are_counted():
    wrong = run_ranks(_count_wrong_of_a_broken_reduction, 2)
    assert wrong[0] == wrong[1] > 0


def test_bad_options_are_refused_before_launching(capsys):
    from ddtrain import cli
    assert cli.main(["bench", "collectives", "--algorithms", "ring,hypercube", "--nproc", "2"]) == 2
    assert "valid: butterfly, central, native, ring, ring-async, tree" in capsys.readouterr().err
    assert cli.main(["bench", "collectives", "--sizes", "1K:1X"]) == 2
    assert "bad size '1X'" in capsys.readouterr().err


def test_cli_end_to_end_on_two_ranks(tmp_path):
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "busbw.png"
    env = dict(os.environ, DDTRAIN_TIMEOUT_S="60")
    out = subprocess.run([sys.executable, "-m", "ddtrain", "bench", "collectives", "--nproc", "2",
                          "--algorithms", "native,ring,butterfly", "--sizes", "64:1K", "--iters", "3",
                          "--warmup", "1", "--budget-s", "0.05", "--calibration-s", "0.5", "--json", str(json_path),
                          "--plot", str(plot_path)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(json_path.read_text())
    rows = result["rows"]
    assert result["world_size"] == 2 and len(rows) == 5 * 3
    assert set(rows[0]) >= {"size_bytes", "count", "type", "algorithm", "time_us", "algbw_GBps", "busbw_GBps",
                            "predicted_us", "error_pct", "wrong", "iters", "cpu_cores"}
    assert all(r["wrong"] == 0 for r in rows)
    for r in rows:
        assert r["count"] * 4 == r["size_bytes"]
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / r["time_us"] / 1e3)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])        # 2(n-1)/n = 1 for n = 2
        assert r["predicted_us"] > 0 and r["cpu_cores"] > 0
        assert r["error_pct"] == pytest.approx(100 * (r["predicted_us"] - r["time_us"]) / r["time_us"])
    assert result["calibration"]["params"]["alpha_s"] > 0
    # The printed table: '#' lines, then data lines with one cell per column.
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# ddtrain bench collectives")
    data = [line.split() for line in lines if not line.startswith("#")]
    assert len(data) == 15 and all(len(cells) == len(COLUMNS) for cells in data)
    assert [int(cells[0]) for cells in data[::3]] == [64, 128, 256, 512, 1024]
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
