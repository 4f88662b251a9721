"""Config files and replays: ``--config run.toml`` / ``.yaml`` (flags override it), ``--config-from RESULTS.json``
(acceptance 4)."""
import argparse
import json
import textwrap

import pytest
import torch

from helpers import REPO, ddtrain

from ddtrain.cli import train
from ddtrain.cli.args import config_from_args
from ddtrain.config import TrainConfig, record_settings, to_argv
from ddtrain.errors import DDTrainError


def resolve(*argv):
    """What ``ddtrain train ARGV`` would run: (config, nproc)."""
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(list(argv))
    args.argv = list(argv)
    return train.resolve(args)


TOML = textwrap.dedent("""
    # a recipe
    model = "mlp"
    data = "digits"
    lr-schedule = "cosine"
    warmup_steps = 3            # dashes or underscores
    lr = 0.2
    grad-accum = 2
    lr-milestones = [1, 2]
    timeout = 60
    profile-warmup-steps = 1

    [model-arg]
    hidden = [32, 16]
""")


def test_a_toml_file_gives_the_settings_and_flags_override_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    config, nproc = resolve("--config", str(path), "--lr", "0.05", "--model-arg", "dropout=0.1")
    assert nproc == (1, 1)   # (MIN, MAX) workers: no --nproc means one
    r = config.recipe
    assert (config.model, config.data.data, r.lr_schedule, r.lr_warmup_steps, r.grad_accum) == \
        ("mlp", "digits", "cosine", 3, 2)
    assert config.recipe.lr == 0.05                                  # the flag wins
    assert config.model_args == {"hidden": [32, 16], "dropout": 0.1}
    assert config.recipe.lr_milestones == "1,2" and config.dist.timeout == 60 and config.profile.warmup_steps == 1
    # the file's values are resolved flags like any other: the workers' argv rebuilds the same config
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    assert config_from_args(parser.parse_args(to_argv(config))) == config


def test_yaml_reads_the_same_keys(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "run.yaml"
    path.write_text("model: mlp\nlr-schedule: onecycle\noptimizer: adamw\nclip-grad: 1.0\n")
    config, _ = resolve("--config", str(path))
    r = config.recipe
    assert (config.model, r.lr_schedule, r.optimizer, r.clip_grad) == ("mlp", "onecycle", "adamw", 1.0)


@pytest.mark.parametrize("text, message", [
    ('model = "mlp"\n\nlr_shedule = "cosine"\n', "{path}:3: unknown key 'lr_shedule' (did you mean 'lr-schedule'?)"),
    ('model = "mlp"\nlr = "fast"\n', "{path}:2: lr = 'fast': expected a number, got str"),
    ('grad-accum = 1.5\n', "{path}:1: grad-accum = 1.5: expected an integer, got float"),
    ('optimizer = "lamb"\n', "{path}:1: optimizer = 'lamb': expected one of: sgd, adam, adamw"),
    ('[sync]\nservers = 2\n', "{path}:1: unknown key 'sync'"),
    ('lr = \n', "{path}: not valid TOML"),
])
def test_a_bad_file_names_the_file_line_and_key(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(DDTrainError) as err:
        resolve("--config", str(path))
    assert str(err.value).startswith(message.format(path=f"--config {path}" if "TOML" in message else path))


def test_the_command_refuses_a_bad_file_with_one_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "mlp"\nwarmup-steps = "ten"\n')
    done = ddtrain("train", "--config", str(path), "--nproc", "2")
    assert done.returncode == 2
    assert done.stderr.strip() == f"ddtrain: error: {path}:2: warmup-steps = 'ten': expected an integer, got str"


@pytest.mark.slow
def test_config_from_a_record_replays_the_run_bit_for_bit(tmp_path):
    """Acceptance 4: ``ddtrain train --config-from run.json`` reproduces the final parameters exactly (CPU)."""
    first = ddtrain("train", "--model", "mlp", "--data", "digits", "--nproc", "2", "--steps", "8", "--grad-accum", "2",
                    "--optimizer", "adamw", "--lr-schedule", "cosine", "--warmup-steps", "2", "--clip-grad", "1.0",
                    "--label-smoothing", "0.1", "--model-arg", "hidden=64", "--quiet",
                    "--out", str(tmp_path / "run.json"), "--save", str(tmp_path / "run.pt"), cwd=REPO)
    assert first.returncode == 0, first.stderr
    again = ddtrain("train", "--config-from", str(tmp_path / "run.json"), "--out", str(tmp_path / "again.json"),
                    "--save", str(tmp_path / "again.pt"), cwd=REPO)
    assert again.returncode == 0, again.stderr
    a, b = torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "again.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (json.loads((tmp_path / n).read_text()) for n in ("run.json", "again.json"))
    assert rb["world_size"] == ra["world_size"] == 2
    outputs = {"out", "save"}
    assert {k: v for k, v in ra["config"].items() if k not in outputs} == \
        {k: v for k, v in rb["config"].items() if k not in outputs}
    # the record's config is complete: it rebuilds the same TrainConfig
    assert TrainConfig.from_dict(ra["config"]).as_dict() == ra["config"]


def committed_records():
    """Every training record committed under results/ (written by earlier versions: some flat, some in sections)."""
    for path in sorted((REPO / "results").rglob("*.json")):
        try:
            record = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("config"), dict) and "strategy" in record["config"]:
            yield path, record


def test_every_committed_record_still_loads_and_round_trips():
    records = list(committed_records())
    assert len(records) > 50
    for path, record in records:
        config = TrainConfig.from_dict(record["config"])
        assert TrainConfig.from_dict(config.as_dict()) == config, path
        settings = record_settings(record["config"])
        assert (config.model, config.data.data, config.recipe.lr, config.recipe.batch_size) == \
            (settings["model"], settings["data"], settings["lr"], settings["batch_size"]), path


def test_an_old_flat_record_replays_with_config_from():
    """Written before the sections (every setting at the top), on 4 GPUs; bench scaling gave its ddp cell
    --sync-every 10, which ddp never read: the replay leaves it out."""
    old = REPO / "results/h200_4gpu/scaling_resnet50/cells/ddp-w4-b256-lw0-bf16.json"
    assert "recipe" not in json.loads(old.read_text())["config"]
    config, nproc = resolve("--config-from", str(old), "--steps", "2")
    assert nproc == (4, 4) and config.steps == 2
    assert (config.model, config.strategy, config.amp, config.channels_last) == ("resnet50", "ddp", "bf16", True)
    assert (config.data.data, config.data.data_args, config.data.val_fraction) == \
        ("synthetic:imagenet", {"samples": 41984, "lazy": "true"}, 0.0)
    assert (config.recipe.batch_size, config.recipe.lr, config.recipe.momentum) == (256, 0.01, 0.9)
    assert config.sync.sync_every == 1 and config.out is None   # unread option and outputs not replayed
    sectioned = REPO / "results/advise/run4/runs/100mbit_local-sgd_nesterov_K=20.json"
    config, nproc = resolve("--config-from", str(sectioned))
    assert nproc == (4, 4) and config.sync.sync_every == 20 and config.sync.outer_optimizer == "nesterov"
    assert config.data.data_args == {"samples": 8448} and config.profile.warmup_steps == 4


def test_config_from_refuses_what_is_no_record(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"epochs": []}')
    with pytest.raises(DDTrainError, match="no 'config' in it"):
        resolve("--config-from", str(path))
