"""What a user sees at the command line: one clear message and a non-zero exit for bad input."""
import json
import subprocess
import sys

import pytest

from helpers import assert_one_clear_error, ddtrain


def test_help_lists_the_commands(capsys):
    from ddtrain import cli
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "demo" in out and "bench collectives" in out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--help"])
    assert exit_.value.code == 0 and "--strategy" in capsys.readouterr().out


@pytest.mark.parametrize("args,phrases", [
    (["--model", "resnet9000"], ["unknown model 'resnet9000'", "simple-cnn"]),
    (["--data", "cifar100:/x"], ["unknown data format 'cifar100'", "mnist:DIR"]),
    (["--data", "mnist:/no/such/dir"], ["/no/such/dir does not exist"]),
    (["--nproc", "0"], ["--nproc must be at least 1"]),
    (["--batch-size", "2000", "--nproc", "2"], ["larger than a rank's shard", "719 each"]),
    (["--strategy", "telepathy"], ["unknown strategy 'telepathy'", "ddp"]),
    (["--lr", "-1"], ["--lr must be positive"]),
    (["--out", "x.txt"], [".json"]),
])
def test_bad_input_gets_one_clear_message(args, phrases, capsys, monkeypatch):
    """Refused in the launching process, before any worker starts (in-process: no spawn cost)."""
    from ddtrain import cli
    from ddtrain.distributed import launch
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(launch, "run_local", lambda *a, **k: pytest.fail("workers were started"))
    code = cli.main(["train", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    for phrase in phrases:
        assert phrase in errors[0], errors[0]


def test_bad_input_from_the_shell_has_no_traceback():
    assert_one_clear_error(ddtrain("train", "--model", "resnet9000"), "unknown model 'resnet9000'")


def test_unknown_command(capsys):
    from ddtrain import cli
    assert cli.main(["trian"]) == 2 and "unknown command 'trian'" in capsys.readouterr().err


def test_two_workers_train_and_write_a_record(tmp_path):
    out, saved = tmp_path / "run.json", tmp_path / "model.pt"
    result = ddtrain("train", "--model", "mlp", "--data", "digits", "--nproc", "2", "--epochs", "2",
                     "--batch-size", "32", "--lr", "0.05", "--momentum", "0.9", "--out", str(out), "--save", str(saved))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Epoch ") == 2  # rank 0 alone prints
    record = json.loads(out.read_text())
    assert record["world_size"] == 2 and record["strategy"] == "ddp" and len(record["epochs"]) == 2
    assert record["final"]["val_accuracy"] > 0.8
    assert [c["rank"] for c in record["comm"]] == [0, 1] and record["comm"][0]["bytes_sent"] > 0
    import torch
    state = torch.load(saved, weights_only=True)
    assert state["1.weight"].shape == (128, 784)


def test_a_failing_worker_ends_the_job_with_its_error_once():
    # rank 1 fails at step 2 while rank 0 waits for its gradients
    result = ddtrain("train", "--model", "mlp", "--data", "digits", "--nproc", "2", "--epochs", "1",
                     env={"DDTRAIN_FAULT": "rank=1,step=2,kind=raise", "DDTRAIN_TIMEOUT_S": "60"})
    assert result.returncode != 0
    assert result.stderr.count("rank 1 deliberately failed") == 1, result.stderr
    # one line, its log named (issue 22)
    assert "[rank 1] ddtrain: error: InjectedFault" in result.stderr and "rank 1's full output: " in result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_help_answers_without_importing_torch():
    # issue 22: `ddtrain --help` took 1.5-5 s because the package imported torch up front
    code = ("import sys; from ddtrain.cli import main; main(['--help']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "bench collectives" in result.stdout
