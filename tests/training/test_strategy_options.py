"""One rule for strategy options (ddtrain.sync.check_options): an option the strategy does not read, set, is refused.

``ddtrain train`` (training.build.validate, before any worker starts), ``fit`` and ``prepare()``
call the same function and say the same words; the command line names the flag where the
library names the field. A TrainConfig itself may carry options for other strategies (a bench
matrix's shared settings): the rule applies where a run starts.
"""
import pytest
import torch

import ddtrain
from ddtrain import fit
from ddtrain.config import TrainConfig
from ddtrain.errors import ConfigError
from ddtrain.sync import STRATEGIES, SyncOptions, check_options
from ddtrain.sync.spec import LOCAL_SGD_OPTIONS
from ddtrain.training.build import validate
from helpers import assert_one_clear_error, ddtrain as run_ddtrain, tiny_data, tiny_model

SERVERS_FOR_DDP = "servers is read only by ps-sync, ps-async, not by strategy 'ddp'"


@pytest.mark.parametrize("field, value", [("outer_optimizer", "nesterov"), ("local_sgd_warmup_steps", 5),
                                          ("adaptive_interval", True), ("servers", 2), ("staleness", 3),
                                          ("sync_every", 4), ("compression", "fp16")])
def test_an_option_the_strategy_does_not_read_is_refused_naming_the_readers(field, value):
    strategy = "ps-async" if field == "sync_every" else "hybrid" if field == "compression" else "ddp"
    with pytest.raises(ConfigError) as caught:
        validate(TrainConfig.from_flat(model="mlp", strategy=strategy, **{field: value}), 2)
    readers = [name for name, spec in STRATEGIES.items() if field in spec.options]
    assert caught.value.field == field
    assert str(caught.value) == f"{field} is read only by {', '.join(readers)}, not by strategy {strategy!r}"


def test_every_strategy_takes_its_own_options_and_the_defaults():
    for name in STRATEGIES:
        check_options(name, SyncOptions())
        TrainConfig(strategy=name)
    check_options("local-sgd", SyncOptions(outer_optimizer="nesterov", local_sgd_warmup_steps=5, sync_every=3))
    check_options("ps-async", SyncOptions(servers=2, staleness=1, async_rule="plain", compression="bf16"))
    check_options("ring", SyncOptions(find_unused_parameters=True, bucket_cap_mb=1, compression="powersgd:2"))


def test_ddp_arguments_pass_everywhere_and_syncbatchnorm_needs_ddps_step():
    for name in STRATEGIES:   # a script that loops over strategies passes DDP's arguments to all
        check_options(name, SyncOptions(find_unused_parameters=True, bucket_cap_mb=1, static_graph=True,
                                        gradient_as_bucket_view=True, no_broadcast_buffers=True, check_every=2))
    with pytest.raises(ConfigError, match="sync_batchnorm is read only by .*hybrid, not by strategy 'local-sgd'"):
        check_options("local-sgd", SyncOptions(sync_batchnorm=True))
    assert [n for n, s in STRATEGIES.items() if s.takes_option("sync_batchnorm")] == \
        [n for n, s in STRATEGIES.items() if s.sync_in_backward]
    assert not set(LOCAL_SGD_OPTIONS) & set(STRATEGIES["ddp"].options)


def test_the_strategys_own_check_runs_once_there():
    with pytest.raises(ConfigError, match="compression powersgd:2 is not supported with parameter servers"):
        validate(TrainConfig.from_flat(model="mlp", strategy="ps-sync", compression="powersgd:2"), 2)


def test_fit_refuses_with_the_same_words():
    model, shape = tiny_model("mlp")
    with pytest.raises(ConfigError) as caught:
        fit(model, tiny_data(shape), TrainConfig.from_flat(model="mlp", strategy="ddp", servers=2, quiet=True))
    assert str(caught.value) == SERVERS_FOR_DDP


def test_prepare_says_the_same_words_and_counts_an_explicit_default():
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as caught:
        ddtrain.prepare(model, sgd, strategy="ddp", servers=2)
    assert str(caught.value) == SERVERS_FOR_DDP
    with pytest.raises(ConfigError, match="servers is read only by"):   # named: set, though 1 is the default
        ddtrain.prepare(model, sgd, strategy="ddp", servers=1)


def test_the_command_line_says_it_in_one_line_naming_the_flag():
    result = run_ddtrain("train", "--strategy", "ddp", "--servers", "2", "--staleness", "3", "--model", "mlp",
                         "--steps", "1")
    assert_one_clear_error(result, "--" + SERVERS_FOR_DDP)
    result = run_ddtrain("train", "--strategy", "ddp", "--outer-optimizer", "nesterov", "--model", "mlp", "--steps", "1")
    assert_one_clear_error(result, "--outer-optimizer is read only by local-sgd, not by strategy 'ddp'")
