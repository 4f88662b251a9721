"""``ddtrain bench scaling``: the matrix, what each cell runs, the derived figures, and one real
two-cell run through the command line (fresh launches, step split adding up, monitor data)."""
import argparse
import io
import json
import subprocess
import sys

import pytest

from ddtrain import cli
from ddtrain.cli.args import config_from_args
from ddtrain.bench.scaling import Cell, ScalingConfig, plan, train_argv
from ddtrain.bench.scaling import finish_rows, network_check, pick_median
from ddtrain.errors import DDTrainError


def _config(**kw):
    base = dict(model="mlp", data="digits", strategies=["ddp"], workers=[1, 2])
    return ScalingConfig.of(**{**base, **kw})


def test_ps_strategies_count_their_servers_on_top_of_the_workers():
    cells = plan(_config(strategies=["ddp", "ps-sync"], workers=[4, 1, 2], servers=2))
    assert [(c.strategy, c.workers, c.ranks) for c in cells] == [
        ("ddp", 1, 1), ("ddp", 2, 2), ("ddp", 4, 4), ("ps-sync", 1, 3), ("ps-sync", 2, 4), ("ps-sync", 4, 6)]


def test_the_matrix_covers_batch_sizes_loader_workers_and_precision():
    cells = plan(_config(workers=[1], batch_sizes=[16, 32], loader_workers=[0, 2], amp=["off", "bf16"]))
    assert len(cells) == 8 and len({c.name for c in cells}) == 8


@pytest.mark.parametrize("kw, message", [
    (dict(steps=10, epochs=2), "exactly one of --steps"),
    (dict(steps=0, epochs=0), "epochs and steps are both 0"),
    (dict(amp=["fp8"]), "unknown --amp mode 'fp8'"),
    (dict(workers=[0, 2]), "--workers must be positive"),
    (dict(strategies=[]), "at least one strategy"),
])
def test_bad_settings_are_refused_before_anything_runs(kw, message):
    with pytest.raises(DDTrainError, match=message):
        _config(**kw)


def test_unknown_strategy_names_the_valid_ones(tmp_path, capsys):
    assert cli.main(["bench", "scaling", "--strategies", "ddp,warp-drive", "--data", "digits",
                     "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown strategy 'warp-drive'; valid:" in err and "ps-sync" in err
    assert not (tmp_path / "cells").exists()


def test_each_cell_trains_with_the_cells_settings_and_the_warmup_on_top(tmp_path):
    config = _config(steps=20, warmup_steps=5, channels_last=True, trace=True, monitor_every=0.25)
    argv = train_argv(config, Cell("ring", 2, 2, 64, 2, "bf16"), tmp_path)
    assert argv[0] == "train"
    # what a worker gets: the flags parsed by the real `ddtrain train` parser
    parser = argparse.ArgumentParser()
    from ddtrain.cli import train as train_cli
    train_cli.add_arguments(parser)
    run = config_from_args(parser.parse_args(argv[1:]))
    assert run.strategy == "ring" and run.recipe.batch_size == 64 and run.data.loader_workers == 2 and run.amp == "bf16"
    assert run.channels_last and run.steps == 25 and run.profile.warmup_steps == 5 and run.profile.profile
    assert run.profile.trace.endswith("ring-w2-b64-lw2-bf16.trace.json") and run.profile.monitor_every == 0.25
    assert run.data.val_fraction == 0 and run.out.endswith("ring-w2-b64-lw2-bf16.json")


def _row(strategy, workers, rate, ok=True):
    return {"strategy": strategy, "workers": workers, "batch_size": 32, "loader_workers": 0, "amp": "off",
            "ok": ok, "samples_per_s": rate}


def test_speedup_and_efficiency_are_against_the_same_strategys_one_worker_cell():
    rows = [_row("ddp", 1, 100.0), _row("ddp", 2, 180.0), _row("ddp", 4, 300.0), _row("ring", 2, 50.0),
            _row("ring", 4, 90.0), _row("ring", 1, 0.0, ok=False)]
    finish_rows(rows)
    assert [round(r["speedup"], 3) for r in rows[:3]] == [1.0, 1.8, 3.0]
    assert [round(r["efficiency"], 3) for r in rows[:3]] == [1.0, 0.9, 0.75]
    # no 1-worker ring cell ran: the 2-worker cell is the baseline, and it says so
    assert rows[3]["baseline_workers"] == 2 and rows[4]["speedup"] == pytest.approx(1.8)
    assert rows[4]["efficiency"] == pytest.approx(0.9) and "speedup" not in rows[5]


def test_repeats_report_each_cells_median_run():
    rows = [dict(_row("ddp", 1, rate), setup="ddp-w1", cell=f"ddp-w1-r{k}") for k, rate in enumerate([90.0, 120.0, 100.0])]
    rows += [dict(_row("ddp", 2, 0.0, ok=False), setup="ddp-w2", cell="ddp-w2"),
             dict(_row("ddp", 2, 150.0), setup="ddp-w2", cell="ddp-w2-r1")]
    one, two = pick_median(rows)
    assert one["cell"] == "ddp-w1-r2" and one["repeats_samples_per_s"] == [90.0, 120.0, 100.0]
    assert two["cell"] == "ddp-w2-r1" and two["repeats_samples_per_s"] == [None, 150.0]
    assert [c.name for c in plan(_config(workers=[2]))] == ["ddp-w2-b32-lw0-off"]


def _samples(t, tx, counted):
    return {"t_s": t, "net_tx_bytes": tx, "net_rx_bytes": tx, "net_tx_packets": tx, "counted_bytes_sent": counted,
            "strategy_bytes_sent": [None] * len(t)}


def test_ranks_sharing_an_interface_are_summed_against_its_counter():
    record = {"profile": {"ranks": [{"role": "worker", "window_s": [1.0, 3.0]}]},
              "monitor": {"ranks": [
                  {"rank": 0, "host": "h", "netns": 1, "interfaces": ["lo"],
                   "samples": _samples([0.5, 1.5, 3.5], [0, 1000, 2100], [0, 400, 900])},
                  {"rank": 1, "host": "h", "netns": 1, "interfaces": ["lo"],
                   "samples": _samples([0.6, 1.6, 3.6], [0, 1000, 2100], [0, 500, 1100])},
                  {"rank": 2, "host": "h", "netns": 2, "interfaces": ["eth0"],
                   "samples": _samples([0.6, 1.6, 3.6], [0, 10, 30], [0, 0, 0])}]}}
    groups = {tuple(g["ranks"]): g for g in network_check(record)}
    shared = groups[(0, 1)]
    assert shared["net_tx_bytes"] == 2100 and shared["ours_sent_bytes"] == 900 + 1100
    assert shared["ratio"] == pytest.approx(2100 / 2000) and shared["ours_method"] == "counted"
    assert groups[(2,)]["ratio"] is None                     # nothing of ours to compare with


def test_a_real_cell_measures_and_splits_every_step(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "ddtrain", "bench", "scaling", "--model", "mlp", "--model-arg",
                           "hidden=512,256", "--data", "digits", "--strategies", "ddp", "--workers", "2",
                           "--batch-sizes", "64", "--steps", "4", "--warmup-steps", "2", "--monitor-every", "0.2",
                           "--out", str(out)], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "# [1/1] ddp, 2 worker(s) (2 ranks)" in proc.stderr        # the progress display
    result = json.loads((out / "scaling.json").read_text())
    (two,) = result["cells"]
    assert two["ok"] and two["speedup"] == 1.0 and two["baseline_workers"] == 2
    assert two["samples_per_s"] == pytest.approx(2 * 64 / two["step_time_s"])
    assert two["epoch_time_kind"] == "extrapolated"
    assert two["epoch_time_s"] == pytest.approx(two["step_time_s"] * two["steps_per_epoch"])
    assert [x["rank"] for x in two["per_rank"]] == [0, 1]
    for x in two["per_rank"]:
        assert abs(x["split_sum_pct"] - 100) <= 5, x                  # acceptance 3: the split adds up
    record = json.loads((out / two["record"]).read_text())
    assert record["profile"]["ranks"][0]["timed_steps"] == 4
    assert len(record["monitor"]["ranks"]) == 2 and record["monitor"]["ranks"][0]["interfaces"]
    assert "samples/s" in (out / "scaling.txt").read_text()


@pytest.mark.parametrize("threads", [1, 3])
def test_every_cell_gets_the_same_threads_per_worker(tmp_path, monkeypatch, threads):
    """Issue 32: each cell's run_local set OMP_NUM_THREADS = cores // ranks, so the 1-worker cell had twice the
    threads of each worker of a 2-worker cell and speed-ups compared threads as much as workers. Every cell's
    launcher now gets --threads-per-worker (1 by default), also after an earlier launch in this process set its own."""
    from ddtrain.bench import cells
    monkeypatch.setattr(cells, "RUNNER", "import os; print('threads', os.environ['OMP_NUM_THREADS'], "
                                         "os.environ.get('DDTRAIN_SET_OMP_NUM_THREADS'))")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("DDTRAIN_SET_OMP_NUM_THREADS", "1")   # what an earlier run_local in this process leaves
    monkeypatch.delenv("DDTRAIN_KEEP_OMP", raising=False)
    config = _config(threads_per_worker=threads)
    for workers in (1, 2):
        cell = Cell("ddp", workers, workers, 32, 0, "off")
        run = cells.run_cell(config, cell, ["train"], tmp_path, cells.Progress(2, stream=io.StringIO()),
                             workers, None)
        assert run["exit_code"] == 0
        assert (tmp_path / f"{cell.name}.log").read_text().split() == ["threads", str(threads), "None"]
    with pytest.raises(DDTrainError, match="--threads-per-worker must be at least 1"):
        _config(threads_per_worker=0)
