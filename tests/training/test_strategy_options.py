"""local-sgd's settings given to another strategy are refused before any worker starts (training/build.validate)."""
import pytest

from ddtrain.config import TrainConfig
from ddtrain.errors import ConfigError
from ddtrain.sync.base import SyncOptions
from ddtrain.training.build import check_strategy_options
from helpers import assert_one_clear_error, ddtrain


@pytest.mark.parametrize("field, value", [("outer_optimizer", "nesterov"), ("local_sgd_warmup_steps", 5),
                                          ("adaptive_interval", True)])
def test_a_local_sgd_setting_for_ddp_is_refused_naming_its_flag(field, value):
    config = TrainConfig(strategy="ddp", sync=SyncOptions(**{field: value}))
    with pytest.raises(ConfigError) as caught:
        check_strategy_options(config)
    assert caught.value.field == field and "local-sgd" in str(caught.value)


def test_local_sgd_takes_them_and_defaults_pass_everywhere():
    check_strategy_options(TrainConfig(strategy="local-sgd", sync=SyncOptions(outer_optimizer="nesterov",
                                                                            local_sgd_warmup_steps=5)))
    for strategy in ("ddp", "ring", "hybrid", "ps-sync"):
        check_strategy_options(TrainConfig(strategy=strategy))


def test_the_command_line_says_it_in_one_line():
    result = ddtrain("train", "--strategy", "ddp", "--outer-optimizer", "nesterov", "--model", "mlp", "--steps", "1")
    assert_one_clear_error(result, "--outer-optimizer", "local-sgd", "--strategy ddp")
