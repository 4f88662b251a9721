"""Issue 32 (a newcomer's run): a finished ``ddtrain train`` names where its outputs went, in one closing line, and a
stop with a checkpoint directory says the exact command that resumes it."""
from ddtrain.cli.train import outputs_line, resume_command
from ddtrain.config import TrainConfig


def test_a_finished_run_names_its_outputs():
    """Was: a finished run never said where its record, model, checkpoints and metrics went."""
    config = TrainConfig.from_flat(model="mlp", data="digits", out="r/run.json", save="m.pt", checkpoint_dir="ck",
                                   csv="metrics.csv", tensorboard="tb")
    assert outputs_line(config) == ("ddtrain: done; outputs: results record r/run.json, model m.pt, checkpoints in "
                                    "ck, metrics CSV metrics.csv, TensorBoard logs in tb")
    assert outputs_line(TrainConfig.from_flat(model="mlp", data="digits")) == (
        "ddtrain: done; nothing was saved (--out FILE keeps the results record, --save FILE the model)")


def test_the_resume_command_is_the_same_command_with_resume():
    """Was: Ctrl-C with --checkpoint-dir said "run the same command with --resume", not the command."""
    argv = ["--model", "mlp", "--nproc", "2", "--checkpoint-dir", "my ck", "--out", "r.json"]
    assert resume_command(argv) == "ddtrain train --model mlp --nproc 2 --checkpoint-dir 'my ck' --out r.json --resume"
    assert resume_command([*argv, "--resume"]).count("--resume") == 1
