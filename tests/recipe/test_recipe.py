"""The recipe's pure parts against torch's own: schedules against torch.optim.lr_scheduler, parameter groups, batch
arithmetic, refusals."""
import math

import pytest
import torch

from ddtrain import TrainConfig, recipe
from ddtrain.cli.args import describe
from ddtrain.errors import ConfigError
from ddtrain.models import build_model
from ddtrain.recipe import RecipeConfig


def torch_lrs(make, n, lr=1.0):
    """The lr of updates 0..n-1 under a torch scheduler built by ``make(optimizer)``."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def ours(schedule, total, warmup=0, **extra):
    config = RecipeConfig(lr_schedule=schedule, lr_warmup_steps=warmup, **extra)
    p = recipe.plan(config, 10, epochs=0, steps=total)
    return [recipe.lr_factor(p, u) for u in range(total)]


def close(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12), (i, x, y)


def test_cosine_after_a_linear_warm_up_is_torchs_cosine_annealing():
    got = ours("cosine", 60, warmup=20)
    close(got[:20], [(u + 1) / 20 for u in range(20)])
    close(got[20:], torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=40), 40))


def test_onecycle_is_torchs_one_cycle():
    ref = torch_lrs(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=50, cycle_momentum=False), 50)
    close(ours("onecycle", 50), ref)
    ref = torch_lrs(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=50, pct_start=0.1,
                                                                  cycle_momentum=False), 50)
    close(ours("onecycle", 50, warmup=5), ref)


def test_linear_step_and_multistep_are_torchs():
    close(ours("linear", 30), torch_lrs(lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.0, total_iters=30), 30))
    # step: every lr_step_epochs (x 10 updates per epoch); multistep: at the milestone epochs
    close(ours("step", 40, lr_step_epochs=1.5, lr_gamma=0.5),
          torch_lrs(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=15, gamma=0.5), 40))
    close(ours("multistep", 40, lr_milestones="1,2.5", lr_gamma=0.1),
          torch_lrs(lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[10, 25], gamma=0.1), 40))
    close(ours("constant", 5, warmup=2), [0.5, 1, 1, 1, 1])


def test_schedule_steps_with_the_optimizer_and_resumes_mid_run():
    config = RecipeConfig(lr_schedule="cosine", lr_warmup_steps=3, lr=0.4)
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.4)
    schedule = recipe.Schedule(opt, recipe.plan(config, 5, epochs=0, steps=10))
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        param.grad = torch.ones(2)
        opt.step()
    close(seen, [schedule.lr(u) for u in range(10)])
    schedule.jump_to(4)
    assert math.isclose(opt.param_groups[0]["lr"], schedule.lr(4))


def test_adamw_keeps_norms_and_biases_out_of_weight_decay():
    model = build_model("resnet18", num_classes=10, in_channels=3, input_size=(32, 32))
    opt = recipe.build_optimizer(RecipeConfig(optimizer="adamw", weight_decay=0.05), model)
    assert isinstance(opt, torch.optim.AdamW)
    decayed, free = opt.param_groups
    assert decayed["weight_decay"] == 0.05 and free["weight_decay"] == 0.0
    norms_and_biases = {id(p) for m in model.modules() if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.Linear))
                        for name, p in m.named_parameters(recurse=False) if isinstance(m, torch.nn.BatchNorm2d)
                        or name == "bias"}
    assert {id(p) for p in free["params"]} == norms_and_biases
    assert len(decayed["params"]) + len(free["params"]) == len(list(model.parameters()))
    sgd = recipe.build_optimizer(RecipeConfig(optimizer="sgd", weight_decay=0.05), model)
    assert len(sgd.param_groups) == 1 and sgd.param_groups[0]["weight_decay"] == 0.05   # sgd's default: decay all


def test_global_batch_divides_into_workers_and_micro_batches():
    config = RecipeConfig(global_batch_size=128, grad_accum=2)
    assert recipe.per_rank_batch(config, 2) == 32 and recipe.global_batch(config, 2) == 128
    assert recipe.resolve(config, 2).batch_size == 32
    assert TrainConfig(recipe=config).resolved(2).recipe == recipe.resolve(config, 2)
    with pytest.raises(ConfigError) as err:
        recipe.per_rank_batch(RecipeConfig(global_batch_size=100, grad_accum=2), 3)
    assert describe(err.value).startswith("--global-batch-size 100 does not divide into 3 worker(s)")
    assert "96, 102" in str(err.value)


def test_a_resize_keeps_the_global_batch_with_the_smallest_accumulation_that_fits():
    """grad_accum_for(global batch, workers, asked): the asked value if it fits, else the smallest larger one (the
    micro-batches no larger than asked), else the largest smaller one, None when the workers cannot share the batch."""
    assert recipe.grad_accum_for(96, 3, 4) == 4          # 3 x 4 x 8 = 96: as asked
    assert recipe.grad_accum_for(96, 2, 5) == 6          # 6, 8, 12, 16, 24, 48 fit: the smallest
    assert recipe.grad_accum_for(96, 4, 16) == 24
    assert recipe.grad_accum_for(96, 48, 16) == 2        # nothing larger fits: the largest below
    assert recipe.grad_accum_for(96, 5, 1) is None


def record(per_epoch=10, **settings):
    config = TrainConfig.from_flat(**settings)
    return recipe.schedule_record(config, recipe.plan(config.recipe, per_epoch, epochs=config.epochs,
                                                      steps=config.steps))


def test_a_schedule_change_is_one_that_gives_an_update_already_trained_another_lr():
    """Resuming after 17 updates: cosine over 17 -> 30 changes updates 1-16; more steps at a constant lr, or a step
    schedule whose period is given, leave every trained update's lr as it was (an uninterrupted run's)."""
    change = recipe.schedule_change(record(steps=17, lr_schedule="cosine"), record(steps=30, lr_schedule="cosine"), 17)
    assert change == ("steps 17 -> 30: cosine over 17 updates -> cosine over 30 updates; update 1 trained at "
                      "0.9915 x the peak lr, which these settings give 0.9973")
    assert recipe.schedule_change(record(steps=17), record(steps=30), 17) is None
    step = dict(lr_schedule="step", lr_step_epochs=1)
    assert recipe.schedule_change(record(steps=30, **step), record(steps=60, **step), 30) is None
    assert "lr_warmup_steps 2 -> 4" in recipe.schedule_change(record(steps=30, lr_warmup_steps=2),
                                                              record(steps=30, lr_warmup_steps=4), 10)
    assert "the updates per epoch" in recipe.schedule_change(record(epochs=2, lr_schedule="linear"),
                                                             record(20, epochs=2, lr_schedule="linear"), 5)
    # cosine over 17 -> 30 after 3 of warm-up: the warm-up's updates 0-3 are equal, update 4 is the first changed
    warm = recipe.schedule_change(record(steps=17, lr_schedule="cosine", lr_warmup_steps=3),
                                  record(steps=30, lr_schedule="cosine", lr_warmup_steps=3), 17)
    assert "update 4 trained at" in warm
    assert recipe.schedule_change(record(steps=17, lr_schedule="cosine", lr_warmup_steps=3),
                                  record(steps=30, lr_schedule="cosine", lr_warmup_steps=3), 4) is None
    assert recipe.schedule_change({"plan": {"schedule": "cosine"}}, record(steps=30), 17) is None   # another version


def test_scale_lr_by_global_batch_over_the_reference():
    config = RecipeConfig(lr=0.1, batch_size=64, grad_accum=2, scale_lr="linear", lr_reference_batch=256)
    assert math.isclose(recipe.scaled_lr(config, 4), 0.1 * 512 / 256)
    config = RecipeConfig(lr=0.1, batch_size=64, scale_lr="sqrt", lr_reference_batch=256)
    assert math.isclose(recipe.scaled_lr(config, 16), 0.1 * 2)


def test_refusals_name_the_flag_and_the_valid_choices():
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_flat(lr_schedule="cosin")
    assert describe(err.value) == ("--lr-schedule 'cosin' is not one of: constant, step, multistep, cosine, "
                                   "onecycle, linear")
    with pytest.raises(ConfigError) as err:
        RecipeConfig(optimizer="lamb")
    assert describe(err.value) == "--optimizer 'lamb' is not one of: sgd, adam, adamw"
    with pytest.raises(ConfigError) as err:
        recipe.plan(RecipeConfig(lr_warmup_steps=60, lr_schedule="cosine"), 10, epochs=0, steps=60)
    assert describe(err.value) == "--warmup-steps 60 is not shorter than the run (60 optimizer updates)"
    with pytest.raises(ConfigError) as err:
        recipe.plan(RecipeConfig(lr_warmup_epochs=3), 10, epochs=2, steps=0)
    assert describe(err.value) == "--warmup-epochs 3 (30 updates) is not shorter than the run (20 optimizer updates)"
