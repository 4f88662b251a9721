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
        # a bench scaling summary's config is the matrix (ScalingConfig.as_dict: a TrainConfig's settings and the
        # axes, batch_sizes among them), not a training record's (results/sharding/scaling_cpu_3ranks/scaling.json)
        if record.get("kind") == "ddtrain-bench-scaling" if isinstance(record, dict) else False:
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


# ---- issue 32: files that are not settings files, and replays of what cannot run here

def record(tmp_path, world_size=2, **settings):
    """A results record of a small run (``--out``'s shape: the resolved config and the world size)."""
    config = TrainConfig.from_flat(**{"model": "mlp", "data": "digits", "steps": 2, "quiet": True,
                                      "model_args": {"hidden": (8,)}, **settings})
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"config": config.as_dict(), "world_size": world_size}))
    return path


def test_a_record_of_a_two_node_job_replays_its_world_size_on_this_machine(tmp_path, capsys):
    """Was: the replay took --nnodes 2 and the old --rdzv-endpoint from the record and waited for a node that never
    came (ignoring SIGTERM). Where a run ran is not replayed, like its outputs; its world size is, here."""
    path = record(tmp_path, world_size=4, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.9:29400")
    config, nproc = resolve("--config-from", str(path))
    assert nproc == (4, 4)
    assert (config.dist.nnodes, config.dist.node_rank, config.dist.rdzv_endpoint) == (1, 0, None)
    assert capsys.readouterr().err.strip() == (
        f"ddtrain: note: --config-from {path}: the record ran on 2 nodes (world size 4); a replay runs on this machine "
        "with --nproc 4; to replay it across nodes give --nnodes, --node-rank, --rdzv-endpoint and --nproc (the "
        "workers of each node)")
    # the flags still place it where the user says
    config, nproc = resolve("--config-from", str(path), "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                            "10.0.0.1:29500", "--nproc", "2")
    assert (config.dist.nnodes, config.dist.node_rank, config.dist.rdzv_endpoint, nproc) == (2, 1, "10.0.0.1:29500",
                                                                                            (2, 2))


@pytest.mark.slow  # a real 2-worker replay
def test_the_command_replays_a_two_node_record_here_instead_of_waiting(tmp_path):
    path = record(tmp_path, world_size=2, nnodes=2, node_rank=0, rdzv_endpoint="127.0.0.1:29999")
    done = ddtrain("train", "--config-from", str(path), "--out", str(tmp_path / "again.json"), timeout=200, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "the record ran on 2 nodes (world size 2); a replay runs on this machine with --nproc 2" in done.stderr
    assert json.loads((tmp_path / "again.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("world_size, shown", [(0, "0"), (-2, "-2"), (True, "true"), ("4", '"4"'), (2.5, "2.5")])
def test_a_record_whose_world_size_is_not_a_worker_count_is_refused_naming_it(tmp_path, world_size, shown):
    """Was: world_size 0 replayed on 1 worker without a word."""
    path = record(tmp_path, world_size=world_size)
    with pytest.raises(DDTrainError) as err:
        resolve("--config-from", str(path))
    assert str(err.value) == (f"--config-from {path}: its 'world_size' is {shown}, not a positive number of workers: the "
                              "record is damaged or was edited; correct it (the run's worker count), or delete the "
                              "field and give --nproc N")


@pytest.mark.parametrize("name, text", [
    ("deep.toml", "lr = " + "[" * 100_000 + "]" * 100_000 + "\n"),
    ("deep.yaml", "lr: " + "[" * 100_000 + "]" * 100_000 + "\n"),
    ("deep.json", '{"config": ' + "[" * 100_000 + "]" * 100_000 + "}"),
], ids=["toml", "yaml", "json"])
def test_a_file_nested_100000_deep_is_one_line_naming_it(tmp_path, name, text):
    """Was: ``ddtrain: error: RecursionError: maximum recursion depth exceeded ...``, the file not named."""
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    path = tmp_path / name
    path.write_text(text)
    flag = "--config-from" if name.endswith(".json") else "--config"
    kind = {"toml": "TOML", "yaml": "YAML", "json": "JSON"}[name.rsplit(".", 1)[1]]
    with pytest.raises(DDTrainError) as err:
        resolve(flag, str(path))
    assert str(err.value) == (f"{flag} {path}: its {kind} is nested too deeply to be read (thousands of levels of "
                              "lists or tables; a settings file has one or two)")


@pytest.mark.parametrize("flag, name", [("--config", "latin1.toml"), ("--config-from", "latin1.json")])
def test_a_file_that_is_not_utf8_is_one_line_naming_it(tmp_path, flag, name):
    path = tmp_path / name
    path.write_bytes('model = "caf\u00e9"\n'.encode("latin-1") if flag == "--config" else b'{"config": "caf\xe9"}')
    with pytest.raises(DDTrainError) as err:
        resolve(flag, str(path))
    offset = path.read_bytes().index(b"\xe9")
    assert str(err.value) == f"{flag} {path}: not UTF-8 text (byte 0xe9 at offset {offset}); save it as UTF-8"


@pytest.mark.parametrize("flag, name", [("--config", "fifo.toml"), ("--config-from", "fifo.json")])
def test_a_fifo_given_as_a_settings_file_is_one_line_not_a_hang(tmp_path, flag, name):
    """Was: the command blocked for ever opening it."""
    import os
    os.mkfifo(tmp_path / name)
    done = ddtrain("train", flag, str(tmp_path / name), timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"ddtrain: error: {flag} {tmp_path / name}: it is a FIFO (named pipe), not a "
                                   "regular file; give a settings file")
