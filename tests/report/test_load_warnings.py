"""The demo and bench scaling say when the machine's load makes a figure meaningless (issue 22: the demo
printed an 8.32x speed-up for 4 workers on 2 cores under load, with no warning)."""
import argparse
import json
import os

from ddtrain.bench.scaling import load_warnings
from ddtrain.cli import demo
from ddtrain.distributed import launch


def _fake_runs(rates: dict, monkeypatch, calls=None):
    """run_local replaced by writing the record a run with these samples/s would write (``calls``: each call's
    worker count, arguments and env)."""
    def run_local(n, argv, **kwargs):
        if calls is not None:
            calls.append((n, argv, kwargs.get("env")))
        out = argv[argv.index("--out") + 1]
        epochs = [{"time_s": 1.0, "samples_per_s": rates[n]} for _ in range(3)]
        with open(out, "w") as f:
            json.dump({"epochs": epochs, "final": {"val_accuracy": 0.9}}, f)
        return 0
    monkeypatch.setattr(launch, "run_local", run_local)


def _demo(tmp_path, workers="1,2,4", threads=None):
    return demo.main(argparse.Namespace(workers=workers, epochs=3, batch_size=32, strategy="ddp",
                                        threads_per_worker=threads, out=str(tmp_path / "demo")))


def test_the_demo_warns_of_a_speedup_above_the_worker_count_and_of_a_busy_machine(tmp_path, monkeypatch, capsys):
    _fake_runs({1: 100.0, 2: 190.0, 4: 832.0}, monkeypatch)
    loads = iter([7.0, 7.5, 8.0, 9.5])
    monkeypatch.setattr(os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert _demo(tmp_path) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("# warning:")]
    assert len(warnings) == 2, out
    assert warnings[0].startswith("# warning: demo: a 8.32x speed-up with 4 workers over 1 is more than 4x, which the "
                                  "workers alone cannot give")
    assert "the 1-min load average was 7.0 on 2 CPU cores before the first run (7.0 besides this run's own " \
           "processes)" in warnings[1]


def test_the_demo_stays_quiet_on_an_idle_machine(tmp_path, monkeypatch, capsys):
    _fake_runs({1: 100.0, 2: 190.0, 4: 330.0}, monkeypatch)
    loads = iter([0.1, 1.0, 2.0, 4.2])  # our own 4 workers on 2 cores are not "other load"
    monkeypatch.setattr(os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert _demo(tmp_path) == 0
    assert "# warning" not in capsys.readouterr().out


def test_bench_scaling_rule():
    assert load_warnings([("ddp batch 32", 4, 2, 2.0)], [("at the start", 0.5, 0)], 8) == []
    lines = load_warnings([("ddp batch 32", 4, 2, 2.5)], [("at the end", 12.0, 4)], 4)
    assert lines[0].startswith("# warning: ddp batch 32: a 2.50x speed-up with 4 workers over 2 is more than 2x")
    assert lines[1].startswith("# warning: the 1-min load average was 12.0 on 4 CPU cores at the end (8.0 besides")


def test_every_worker_count_gets_the_same_threads_and_the_machine_is_described_before_the_first_run(
        tmp_path, monkeypatch, capsys):
    """Issue 32: OMP_NUM_THREADS = cores // workers gave the 1-worker baseline 2 threads and each of several
    workers 1, so on a busy machine the baseline ran up to 17x slower than on one thread and the demo printed a
    9.5x speed-up for 2 workers with "not meaningful" warnings after minutes; nothing was printed during a run."""
    calls = []
    _fake_runs({1: 100.0, 2: 190.0, 4: 330.0}, monkeypatch, calls)
    loads = iter([5.0, 5.0, 5.0, 5.0])
    monkeypatch.setattr(os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _demo(tmp_path) == 0
    assert [(n, env) for n, _, env in calls] == [(1, {"OMP_NUM_THREADS": "1"}), (2, {"OMP_NUM_THREADS": "1"}),
                                                 (4, {"OMP_NUM_THREADS": "1"})]
    assert all("--quiet" not in argv for _, argv, _ in calls)   # rank 0's epoch lines are the progress
    lines = capsys.readouterr().out.splitlines()
    first_run = lines.index("# [1/3] training with 1 worker(s) x 1 thread(s) ...")
    before = "\n".join(lines[:first_run])
    assert "every worker runs 1 thread(s) (OMP_NUM_THREADS=1) at every worker count" in before
    assert "this machine has 2 CPU core(s): at most 2 worker(s) of 1 thread(s) run at once, so 4 workers share " \
           "cores and their speed-up over 1 worker(s) cannot pass 2x" in before
    assert "the machine is already busy (1-min load average 5.0 on 2 cores)" in before
    assert any(line.startswith("# workers  threads/worker  epoch time (s)") for line in lines)


def test_the_users_own_thread_count_is_kept_for_every_run(tmp_path, monkeypatch, capsys):
    calls = []
    _fake_runs({1: 100.0, 2: 190.0}, monkeypatch, calls)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("DDTRAIN_SET_OMP_NUM_THREADS", raising=False)
    assert _demo(tmp_path, workers="1,2") == 0
    assert [env for _, _, env in calls] == [{"OMP_NUM_THREADS": "2"}] * 2
    assert _demo(tmp_path, workers="1,2", threads=3) == 0
    assert [env for _, _, env in calls[2:]] == [{"OMP_NUM_THREADS": "3"}] * 2
