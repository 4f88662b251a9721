"""The recipe as a user runs it: examples/recipes/cifar_resnet18.toml on 2 workers (a short variant of acceptance 1),
and bad input refused before any worker."""
import json
import math
import subprocess

import pytest

from ddtrain.config import record_settings
from helpers import REPO, assert_one_clear_error, ddtrain

RECIPE = str(REPO / "examples" / "recipes" / "cifar_resnet18.toml")


@pytest.mark.slow
def test_the_resnet18_recipe_runs_on_two_workers_with_accumulation_and_tensorboard(tmp_path):
    """Acceptance 1's command, shortened: 640 synthetic CIFAR-10 images, global batch 32, 6 updates."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    done = ddtrain("train", "--model", "resnet18", "--data", "synthetic:cifar10", "--data-arg", "samples=640",
                   "--nproc", "2", "--global-batch-size", "32", "--grad-accum", "2", "--optimizer", "adamw",
                   "--lr-schedule", "cosine", "--warmup-steps", "2", "--clip-grad", "1.0", "--label-smoothing", "0.1",
                   "--tensorboard", str(tmp_path / "tb"), "--config", RECIPE, "--steps", "6",
                   "--out", str(tmp_path / "run.json"), timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "run.json").read_text())
    config = record_settings(record["config"])
    assert (config["batch_size"], config["grad_accum"], record["global_batch_size"]) == (8, 2, 32)  # 32 / (2 x 2)
    assert (config["weight_decay"], config["lr"], config["val_fraction"]) == (0.05, 0.002, 0.1)       # from the file
    assert sum(e["steps"] for e in record["epochs"]) == 6
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    lr = [e.value for e in events.Scalars("step/lr")]
    expected = [0.002 * 0.5, 0.002] + [0.002 * 0.5 * (1 + math.cos(math.pi * u / 4)) for u in range(4)]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(lr, expected)) and len(lr) == 6


def refused(capsys, *argv):
    """``ddtrain train ARGV`` in this process: every refusal below comes before any worker starts."""
    from ddtrain.cli import main
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def test_bad_recipes_are_one_message_before_any_worker(tmp_path, capsys):
    base = ["--model", "mlp", "--data", "digits", "--nproc", "3"]
    assert_one_clear_error(refused(capsys, *base, "--steps", "10", "--warmup-steps", "10"),
                           "--warmup-steps 10 is not shorter than the run (10 optimizer updates)")
    assert_one_clear_error(refused(capsys, *base, "--global-batch-size", "100", "--grad-accum", "2"),
                           "--global-batch-size 100 does not divide into 3 worker(s) x --grad-accum 2")
    assert_one_clear_error(refused(capsys, *base, "--epochs", "1", "--warmup-epochs", "2"),
                           "--warmup-epochs 2 (")
    blocker = tmp_path / "file"
    blocker.write_text("")
    if __import__("importlib").util.find_spec("tensorboard"):
        assert_one_clear_error(refused(capsys, *base, "--tensorboard", str(blocker / "tb")),
                               "--tensorboard", "cannot write there")
    with pytest.raises(SystemExit):   # argparse lists the valid choices itself
        refused(capsys, *base, "--lr-schedule", "cosin")
    err = capsys.readouterr().err   # the quoting of the choices differs between Python versions
    assert "--lr-schedule: invalid choice: 'cosin'" in err
    assert all(name in err for name in ("constant", "step", "multistep", "cosine", "onecycle", "linear"))
