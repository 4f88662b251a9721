"""``--compile-options auto`` weighs the tuning's longer compile against the run's length (issue 30).

The rule is pure (device, ranks, planned steps -> options); torch.compile itself is not run here.
"""
import torch

from ddtrain.training.compiled import TUNE_MIN_STEPS, TUNED, choose, options

CUDA = torch.device("cuda", 0)      # a device object only: nothing runs on it


def test_short_runs_take_torch_compiles_defaults_long_runs_tune():
    name, why = choose("auto", CUDA, 1, planned_steps=500)          # a benchmark or a smoke test
    assert name == "default" and "500 steps are fewer than the 100000" in why
    assert options("auto", CUDA, 1, planned_steps=500) == {}
    assert choose("auto", CUDA, 1, planned_steps=450_000)[0] == "tuned-graphs"   # ImageNet, 90 epochs at 256
    assert options("auto", CUDA, 1, planned_steps=450_000) == {**TUNED, "triton.cudagraphs": True}
    assert choose("auto", CUDA, 4, planned_steps=450_000)[0] == "tuned"         # no CUDA graphs around the all-reduce
    assert options("auto", CUDA, 4, planned_steps=TUNE_MIN_STEPS) == TUNED
    assert choose("auto", CUDA, 1, planned_steps=TUNE_MIN_STEPS - 1)[0] == "default"


def test_an_explicit_choice_is_kept_and_off_cuda_there_are_no_options():
    assert choose("tuned-graphs", CUDA, 1, planned_steps=10) == ("tuned-graphs", "asked for")
    assert options("tuned", CUDA, 1, planned_steps=10) == TUNED
    assert choose("auto", CUDA, 1)[0] == "tuned-graphs"                # a caller that does not know the length
    assert choose("tuned-graphs", torch.device("cpu"), 1, 10**6)[0] == "default"
    assert options("auto", torch.device("cpu"), 1, 10**6) == {}


def test_the_threshold_is_the_measured_break_even_rounded_up():
    """180 s more compile (issue 30, H200) over 2.6 ms saved a step (defaults5.json, H100: 256/5605 - 256/5937 s)."""
    saved_s = 256 / 5605 - 256 / 5937
    break_even = 180 / saved_s
    assert 60_000 < break_even < TUNE_MIN_STEPS <= 1.5 * break_even
