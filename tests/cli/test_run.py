"""``ddtrain run``: any script on N local workers, as torchrun runs it, with ddtrain train's failure naming and checks."""
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
