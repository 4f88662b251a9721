"""``ddtrain run``: any script on N local workers, as torchrun runs it, with ddtrain train's failure naming and checks,
and its launch flags: MIN:MAX workers (a lost worker: the script restarted at the smaller size), several nodes."""
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO, assert_one_clear_error, ddtrain

SCRIPT = textwrap.dedent("""
    import os
    import sys
    import torch
    import ddtrain

    ddtrain.init()
    model = torch.nn.Linear(2, 2)
    model, optimizer, _ = ddtrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    line = (f"rank {ddtrain.rank()} of {ddtrain.world_size()}: strategy {model.strategy.spec.name}, "
            f"argv {sys.argv[1:]}, main {__name__}\\n")
    os.write(1, line.encode())  # one write: the two ranks share the launcher's stdout pipe, lines stay whole
    if "--fail" in sys.argv and ddtrain.rank() == 1:
        sys.exit(3)
    ddtrain.shutdown()
""")


@pytest.mark.slow
def test_prints_what_torchrun_prints_for_the_minimal_example():
    """Acceptance 3: ``ddtrain run --nproc 2 examples/minimal.py`` = ``torchrun --nproc-per-node 2 examples/minimal.py``."""
    ours = ddtrain("run", "--nproc", "2", "examples/minimal.py", "--epochs", "1", cwd=REPO)
    theirs = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "examples/minimal.py", "--epochs", "1"], capture_output=True, text=True, timeout=240,
                            cwd=REPO)
    assert ours.returncode == theirs.returncode == 0, ours.stderr + theirs.stderr
    assert ours.stdout == theirs.stdout
    assert "epoch 1: loss" in ours.stdout and "(world size 2)" in ours.stdout


def test_strategy_and_arguments_reach_the_script_and_a_failure_names_the_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    failed = ddtrain("run", "--nproc", "2", "--strategy", "ring", str(script), "--lr", "0.1", "--fail")
    lines = sorted(line for line in failed.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} of 2: strategy ring, argv ['--lr', '0.1', '--fail'], main __main__" for r in (0, 1)]
    assert failed.returncode == 3, failed.stderr
    errors = [line for line in failed.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("ddtrain: error: worker rank 1 failed with exit code 3"), errors


def run_here(capsys, *argv):
    """``ddtrain run ARGV`` in this process (refusals come before any worker, so no process is needed)."""
    from ddtrain.cli import main
    code = main(["run", *argv])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def test_bad_input_is_one_clear_message_before_any_worker_starts(tmp_path, capsys):
    assert_one_clear_error(run_here(capsys, "--nproc", "2", str(tmp_path / "missing.py")), "missing.py: no such script")
    script = tmp_path / "job.py"
    script.write_text("print('started')\n")
    bad = run_here(capsys, "--nproc", "2", "--strategy", "rings", str(script))
    assert_one_clear_error(bad, "rings", "ring", "ps-sync")
    assert "started" not in bad.stdout
    assert_one_clear_error(run_here(capsys, "--nproc", "0", str(script)), "--nproc must be at least 1")
    assert_one_clear_error(run_here(capsys, "--timeout", "-1", str(script)), "--timeout must be a positive")
    from ddtrain.cli import main                          # the mistake the issue quotes: a script given to train
    code = main(["train", str(script), "--nproc", "2"])
    out, err = capsys.readouterr()
    assert_one_clear_error(subprocess.CompletedProcess([], code, out, err), "ddtrain train takes flags, not a script",
                           f"ddtrain run --nproc N {script} ARGS")


# ---- the launch flags of ddtrain train (issue 28 item 3): the same library policy, the same messages ----

def test_min_max_workers_and_nodes_reach_the_launch_policy(tmp_path, capsys, monkeypatch):
    from ddtrain.cli.run import SCRIPT_MODULE
    from ddtrain.distributed import launch
    calls = []
    monkeypatch.setattr(launch, "run_elastic", lambda sizes, argv, **kw: calls.append(("elastic", sizes, argv, kw)))
    monkeypatch.setattr(launch, "run_local", lambda nproc, argv, **kw: calls.append(("local", nproc, argv, kw)))
    monkeypatch.delenv("DDTRAIN_RUN_ID", raising=False)
    script = tmp_path / "job.py"
    script.write_text("print('started')\n")
    run_here(capsys, "--nproc", "1:5", "--checkpoint-dir", "ck", "--global-batch-size", "20", "--max-restarts", "2",
             str(script), "--lr", "1")
    kind, sizes, argv, kw = calls.pop()
    assert (kind, sizes, argv) == ("elastic", [5, 4, 2, 1], [str(script), "--lr", "1"])   # 3 does not divide 20
    assert kw["limits"] == (1, 5) and kw["max_restarts"] == 2 and kw["module"] == SCRIPT_MODULE
    assert kw["env"]["DDTRAIN_CHECKPOINT_DIR"] == os.path.abspath("ck")   # the workers may change directory
    assert kw["env"]["DDTRAIN_GLOBAL_BATCH_SIZE"] == "20"
    run_here(capsys, "--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29411",
             str(script))
    kind, nproc, argv, kw = calls.pop()
    assert (kind, nproc, kw["nodes"], kw["max_restarts"]) == ("local", 2, ("2", 1, "127.0.0.1:29411"), 0)
    monkeypatch.setenv("DDTRAIN_GLOBAL_BATCH_SIZE", "8")       # a script's global batch stated by the variable
    monkeypatch.setenv("DDTRAIN_CHECKPOINT_DIR", str(tmp_path / "state"))
    run_here(capsys, "--nproc", "3:4", str(script))
    kind, sizes, _, kw = calls.pop()
    assert sizes == [4] and kw["env"]["DDTRAIN_CHECKPOINT_DIR"] == str(tmp_path / "state")


def test_the_script_s_variables_are_read_by_the_library(monkeypatch):
    from ddtrain.distributed import job
    env = {"DDTRAIN_CHECKPOINT_DIR": "/ck", "DDTRAIN_GLOBAL_BATCH_SIZE": "48"}
    assert (job.checkpoint_dir(env), job.global_batch_size(env)) == ("/ck", 48)
    assert (job.checkpoint_dir({}), job.global_batch_size({})) == (None, 0)
    with pytest.raises(Exception, match="DDTRAIN_GLOBAL_BATCH_SIZE='4.5' must be a positive whole number"):
        job.global_batch_size({"DDTRAIN_GLOBAL_BATCH_SIZE": "4.5"})


BAD_LAUNCH = [
    (["--nproc", "3:2"], "--nproc MIN 3 is more than MAX 2 in '3:2'"),
    (["--nproc", "0:2"], "--nproc MIN must be at least 1, got '0:2'"),
    (["--nproc", "1:2"], "--nproc 1:2 needs --checkpoint-dir DIR"),
    (["--nproc", "1:2", "--checkpoint-dir", "{tmp}/ck"], "--nproc 1:2 needs --global-batch-size"),
    (["--nproc", "3:4", "--checkpoint-dir", "{tmp}/ck", "--global-batch-size", "5"],
     "--nproc 3:4: --global-batch-size 5 runs on none of them; world sizes that can share it: 1, 5"),
    (["--nproc", "3:4", "--checkpoint-dir", "{tmp}/ck", "--global-batch-size", "6"],
     "--nproc 3:4: --global-batch-size 6 cannot start on 4; world sizes that can share it: 1, 2, 3, 6"),
    (["--nproc", "2", "--global-batch-size", "7"], "--global-batch-size 7 cannot be shared by 2 worker(s)"),
    (["--nproc", "2:3", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--checkpoint-dir", "{tmp}/ck",
      "--global-batch-size", "6"], "--nproc 2:3 is for one machine"),
    (["--nnodes", "2"], "--rdzv-endpoint a multi-node launch needs HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400"], "--node-rank must be in 0..1"),
    (["--nnodes", "2:3", "--rdzv-endpoint", "127.0.0.1:29400", "--checkpoint-dir", "{tmp}/ck"],
     "--nnodes 2:3 needs --max-restarts of at least 1"),
    (["--nnodes", "2:3", "--rdzv-endpoint", "127.0.0.1:29400", "--max-restarts", "1", "--checkpoint-dir", "{tmp}/ck",
      "--global-batch-size", "4"], "--nnodes 2:3 with --nproc 1: --global-batch-size 4 cannot start on 3"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
]


@pytest.mark.parametrize("flags, words", BAD_LAUNCH, ids=[" ".join(f) for f, _ in BAD_LAUNCH])
def test_bad_launch_flags_are_one_line_before_any_worker_starts(flags, words, tmp_path, capsys, monkeypatch):
    from ddtrain.distributed import launch
    monkeypatch.setattr(launch, "run_local", lambda *a, **k: pytest.fail("workers were started"))
    monkeypatch.delenv("DDTRAIN_RUN_ID", raising=False)
    script = tmp_path / "job.py"
    script.write_text("print('started')\n")
    assert_one_clear_error(run_here(capsys, *[f.format(tmp=tmp_path) for f in flags], str(script)), words)
    assert not (tmp_path / "ck").exists()


def test_a_bad_range_from_the_shell_is_one_line(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("print('started')\n")
    refused = ddtrain("run", "--nproc", "1:2", "--global-batch-size", "4", str(script))
    assert_one_clear_error(refused, "--nproc 1:2 needs --checkpoint-dir DIR")
    assert "started" not in refused.stdout
    bad = ddtrain("run", "--nproc", "2", str(script), env={"DDTRAIN_GLOBAL_BATCH_SIZE": "many"})
    assert_one_clear_error(bad, "DDTRAIN_GLOBAL_BATCH_SIZE='many' must be a positive whole number")


RECORDING_SCRIPT = textwrap.dedent("""
    import os
    import signal
    import sys
    import torch
    import torch.distributed as dist
    import ddtrain
    from ddtrain.distributed import job

    told = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["WORLD_SIZE"], os.environ["RANK"]  # before init
    ddtrain.init()
    rank, world = ddtrain.rank(), ddtrain.world_size()
    line = (f"{job.restart_attempt()} {world} {rank} {' '.join(told)} {job.checkpoint_dir()} "
            f"{job.global_batch_size()}\\n")
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, line.encode())   # one write per rank: lines stay whole
    os.close(fd)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)        # every rank has written its line
    if "--kill" in sys.argv and job.restart_attempt() == 0 and rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    check = torch.ones(1)
    dist.all_reduce(check)
    assert total.item() == world * (world - 1) / 2 and check.item() == world
    ddtrain.shutdown()
""")
ENV = {"OMP_NUM_THREADS": "1", "DDTRAIN_TIMEOUT_S": "60"}


def _records(path):
    return sorted(tuple(line.split()) for line in path.read_text().splitlines())


@pytest.mark.slow
def test_nproc_2_3_goes_on_at_2_in_attempt_1_after_a_worker_is_killed(tmp_path):
    script, out = tmp_path / "job.py", tmp_path / "seen.txt"
    script.write_text(RECORDING_SCRIPT)
    result = ddtrain("run", "--nproc", "2:3", "--checkpoint-dir", str(tmp_path / "ck"), "--global-batch-size", "6",
                     str(script), str(out), "--kill", env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "worker rank 2 was killed by SIGKILL; going on with 2 workers (--nproc 2:3) from the last checkpoint" \
        in result.stderr, result.stderr[-3000:]
    ck = str(tmp_path / "ck")
    # (attempt, world size, rank, TORCHELASTIC_RESTART_COUNT, WORLD_SIZE, RANK, checkpoint dir, global batch)
    assert _records(out) == sorted([("0", "3", str(r), "0", "3", str(r), ck, "6") for r in range(3)]
                                   + [("1", "2", str(r), "1", "2", str(r), ck, "6") for r in range(2)])


@pytest.mark.slow
def test_nnodes_2_as_two_launchers_on_one_machine_is_one_world(tmp_path):
    from ddtrain.distributed.launch import free_port
    script, out = tmp_path / "job.py", tmp_path / "seen.txt"
    script.write_text(RECORDING_SCRIPT)
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, **ENV}
    env.pop("RANK", None)
    nodes = [subprocess.Popen([sys.executable, "-m", "ddtrain", "run", "--nproc", "2", "--nnodes", "2", "--node-rank",
                               str(node), "--rdzv-endpoint", endpoint, str(script), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for node in (0, 1)]
    try:
        results = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in results]
    # node 0's launcher runs ranks 0 and 1, node 1's ranks 2 and 3: one world of 2 x 2
    assert _records(out) == sorted([("0", "4", str(r), "0", "4", str(r), "None", "0") for r in range(4)])
