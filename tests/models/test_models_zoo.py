"""The model zoo against its sources: published parameter counts, document 000's Table 6.4
shapes, small-input forwards, and counted FLOPs against hand counts and published figures.

Big models are built on the meta device (shapes only, no memory, no arithmetic); real
forward passes run only at small sizes.
"""
import functools

import pytest
import torch
import torch.nn as nn

from ddtrain.errors import DDTrainError
from ddtrain.models import MODELS, build_model, model_summary, parameter_count
from ddtrain.models.flops import (REFERENCE_INPUTS, count_flops, format_table,
                                  reference_table)


@functools.cache
def meta_model(name, num_classes=1000, in_channels=3, size=224, version=None):
    """The model on the meta device (cached: tests only read these)."""
    options = {} if version is None else {"version": version}
    with torch.device("meta"):
        return build_model(name, num_classes=num_classes, in_channels=in_channels,
                           input_size=(size, size), **options)


def running_stats(model):
    """Batch norm moving mean and variance, which Keras counts in 'Total params'."""
    return sum(b.numel() for name, b in model.named_buffers()
               if name.endswith(("running_mean", "running_var")))


# torchvision's model table (learnable parameters, 1000 classes, 224x224)
TORCHVISION_PARAMS = {
    "alexnet": 61_100_840, "vgg16": 138_357_544, "vgg19": 143_667_240,
    "resnet18": 11_689_512, "resnet50": 25_557_032, "resnet152": 60_192_808,
}
# Keras applications 'Total params' (parameters + batch norm moving mean/variance);
# 25,613,800 is also document 003's figure for ResNet50V2
KERAS_TOTAL_PARAMS = {"resnet50v2": 25_613_800, "resnet152v2": 60_380_648}


@pytest.mark.parametrize("name", sorted(TORCHVISION_PARAMS))
def test_parameter_count_equals_torchvision(name):
    assert parameter_count(meta_model(name)) == TORCHVISION_PARAMS[name]


@pytest.mark.parametrize("name", sorted(KERAS_TOTAL_PARAMS))
def test_parameters_plus_bn_statistics_equal_keras_total(name):
    model = meta_model(name)
    assert parameter_count(model) + running_stats(model) == KERAS_TOTAL_PARAMS[name]
    assert model_summary(model, (3, 224, 224))["buffers"] == running_stats(model)


def test_simple_cnn_parameter_count_is_table_6_3():
    assert parameter_count(meta_model("simple-cnn", 10, 1, 28)) == 1_199_882


def test_resnet_v1_has_the_same_parameters_as_v1_5():
    assert parameter_count(meta_model("resnet50", version="1")) == 25_557_032
    assert parameter_count(meta_model("resnet50", version=1)) == 25_557_032  # as --model-arg gives it


# Document 000, Table 6.4, transcribed as printed (Keras NHWC shapes, batch dim dropped).
TABLE_6_4 = {
    "input": (192, 192, 97),
    "block1.convs": (192, 192, 32), "block1.pool": (96, 96, 32),
    "block2.convs": (96, 96, 64), "block2.pool": (48, 48, 64),
    "block3.convs": (48, 48, 128), "block3.pool": (24, 24, 128),
    "block4.convs": (24, 24, 256), "block4.pool": (12, 12, 256),
    "block5": (12, 12, 512),
    "block6.upsample": (24, 24, 512), "block6.up_conv": (24, 24, 256),
    "block6.concatenate": (24, 24, 512), "block6.convs": (24, 24, 256),
    "block7.upsample": (48, 48, 256), "block7.up_conv": (48, 48, 128),
    "block7.concatenate": (48, 48, 256), "block7.convs": (48, 48, 128),
    "block8.upsample": (96, 96, 128), "block8.up_conv": (96, 96, 64),
    "block8.concatenate": (96, 96, 128), "block8.convs": (96, 96, 64),
    "block9.upsample": (192, 192, 64), "block9.up_conv": (192, 192, 32),
    "block9.concatenate": (192, 192, 64), "block9.convs": (192, 192, 32),
    "output": (192, 192, 1),
}


def unet_block_shapes(model, x):
    """Run ``model`` on ``x`` and record each block's output as (H, W, C), keyed as in the table."""
    shapes = {"input": x.shape}
    modules = {f"block{i + 1}.{part}": getattr(block, part)
               for i, block in enumerate(model.down) for part in ("convs", "pool")}
    modules["block5"] = model.bridge
    depth = len(model.down)
    for i, block in enumerate(model.up):
        for part in ("upsample", "up_conv", "convs"):
            modules[f"block{depth + 2 + i}.{part}"] = getattr(block, part)
    modules["output"] = model.head
    hooks = [m.register_forward_hook(lambda m, args, out, key=key: shapes.__setitem__(key, out.shape))
             for key, m in modules.items()]
    # the concatenation is not a module: it is what the two convolutions receive
    hooks += [block.convs.register_forward_pre_hook(
        lambda m, args, key=f"block{depth + 2 + i}.concatenate": shapes.__setitem__(key, args[0].shape))
        for i, block in enumerate(model.up)]
    model(x)
    for h in hooks:
        h.remove()
    return {key: (s[2], s[3], s[1]) for key, s in shapes.items()}


def test_unet_block_shapes_match_table_6_4():
    model = meta_model("unet", num_classes=1, in_channels=97, size=192)
    shapes = unet_block_shapes(model, torch.empty(2, 97, 192, 192, device="meta"))
    assert shapes == TABLE_6_4


def test_unet_layers_match_table_6_4():
    model = meta_model("unet", num_classes=1, in_channels=97, size=192)

    def kinds(seq):
        return [(type(m).__name__, getattr(m, "kernel_size", None), getattr(m, "p", None))
                for m in seq if not isinstance(m, nn.ReLU)]

    for block in model.down:  # two 3x3 convs, batch norm, 25% dropout, 2x2 max-pool
        assert kinds(block.convs) == [("Conv2d", (3, 3), None), ("Conv2d", (3, 3), None),
                                      ("BatchNorm2d", None, None), ("Dropout", None, 0.25)]
        assert block.pool.kernel_size == 2 and block.pool.stride == 2
    assert kinds(model.bridge)[-1] == ("Dropout", None, 0.5)
    for block in model.up:  # conv after upsampling; two 3x3 convs then batch norm
        assert block.up_conv[0].kernel_size == (3, 3)
        assert kinds(block.convs) == [("Conv2d", (3, 3), None), ("Conv2d", (3, 3), None),
                                      ("BatchNorm2d", None, None)]
    assert model.head.kernel_size == (1, 1) and model.head.out_channels == 1


def test_unet_reduced_width_and_resolution_trains_on_cpu():
    torch.manual_seed(0)
    model = build_model("unet", num_classes=1, in_channels=2, input_size=(64, 64), base=4)
    x, y = torch.randn(3, 2, 64, 64), torch.randn(3, 1, 64, 64)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    assert model(x).shape == (3, 1, 64, 64)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_unet_depth_width_and_outputs_are_configurable():
    model = build_model("unet", in_channels=5, input_size=(32, 48), base=3, depth=2,
                        out_channels=2)
    assert len(model.down) == 2 and len(model.up) == 2
    assert model.bridge[0].out_channels == 12  # base * 2**depth
    assert model.eval()(torch.randn(1, 5, 32, 48)).shape == (1, 2, 32, 48)


def test_unet_rejects_sizes_the_pools_cannot_halve():
    with pytest.raises(DDTrainError, match="divisible by 16"):
        build_model("unet", in_channels=2, input_size=(174, 145))


@pytest.mark.parametrize("name", ["simple-cnn", "alexnet", "vgg16", "resnet18", "resnet50",
                                  "resnet50v2"])
def test_cifar_sized_forward(name):
    """A real forward on 32x32 RGB images with 10 classes (document 002's setting)."""
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, in_channels=3, input_size=(32, 32)).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["vgg19", "resnet152", "resnet152v2"])
def test_cifar_sized_forward_shape_of_the_deepest(name):
    """The deepest models repeat the blocks of vgg16 / resnet50 / resnet50v2 (which run for
    real above); their 32x32 forward is checked on the meta device to keep the suite fast."""
    model = meta_model(name, num_classes=10, size=32)
    assert model(torch.empty(2, 3, 32, 32, device="meta")).shape == (2, 10)


@pytest.mark.parametrize("name", ["resnet50v2", "resnet18"])
def test_document_003_input_size_forward(name):
    """Document 003 resizes CIFAR-10 to 128x128 for ResNet50V2."""
    model = build_model(name, num_classes=10, in_channels=3, input_size=(128, 128)).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 128, 128)).shape == (1, 10)


def test_small_inputs_keep_the_224_parameter_count():
    """The adaptive pools make the count independent of the input size."""
    for name in ("alexnet", "vgg16"):
        assert (parameter_count(meta_model(name, size=32))
                == parameter_count(meta_model(name, size=224)) == TORCHVISION_PARAMS[name])


def test_too_small_inputs_fail_with_one_clear_error():
    with pytest.raises(DDTrainError, match="at least 32x32"):
        build_model("vgg16", in_channels=3, input_size=(16, 16))
    with pytest.raises(DDTrainError, match="at least 7x7"):
        build_model("alexnet", in_channels=3, input_size=(6, 6))
    with pytest.raises(DDTrainError, match="resnet version"):
        build_model("resnet50", in_channels=3, input_size=(32, 32), version="2")
    with pytest.raises(DDTrainError, match="unexpected keyword"):
        build_model("resnet18", in_channels=3, input_size=(32, 32), widht=2)


def test_flops_of_one_conv_and_one_linear_equal_hand_count():
    conv = nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=1)
    out_hw = (17 + 2 * 1 - 3) // 2 + 1  # 9
    assert count_flops(conv, (3, 17, 17)) == 2 * (8 * out_hw * out_hw) * (3 * 3 * 3)
    assert count_flops(nn.Linear(20, 7), (20,)) == 2 * 20 * 7


def test_simple_cnn_flops_equal_hand_count():
    macs = (26 * 26 * 32 * (1 * 3 * 3)      # conv 3x3, 1 -> 32
            + 24 * 24 * 64 * (32 * 3 * 3)   # conv 3x3, 32 -> 64
            + 9216 * 128 + 128 * 10)        # dense layers
    assert count_flops(meta_model("simple-cnn", 10, 1, 28), (1, 28, 28)) == 2 * macs


# Published multiply-adds (G) at 224x224; FLOPs here are 2 per multiply-add.
# Document 002, Table 3.1 (one decimal; its ResNets are the original v1 layout):
DOC_002_GMACS = {("alexnet", "1.5"): 0.7, ("vgg16", "1.5"): 15.5, ("vgg19", "1.5"): 19.6,
                 ("resnet50", "1"): 3.9, ("resnet152", "1"): 11.3}
# torchvision's model table "GFLOPS" column (two decimals; multiply-adds, v1.5 ResNets):
TORCHVISION_GMACS = {"alexnet": 0.71, "vgg16": 15.47, "vgg19": 19.63, "resnet18": 1.81,
                     "resnet50": 4.09, "resnet152": 11.51}


@pytest.mark.parametrize("name,version", sorted(DOC_002_GMACS))
def test_flops_match_document_002_table_3_1(name, version):
    flops = count_flops(meta_model(name, version=version if name.startswith("resnet") else None),
                        (3, 224, 224))
    assert round(flops / 2e9, 1) == DOC_002_GMACS[(name, version)]


@pytest.mark.parametrize("name", sorted(TORCHVISION_GMACS))
def test_flops_match_torchvision_table(name):
    assert round(count_flops(meta_model(name), (3, 224, 224)) / 2e9, 2) == TORCHVISION_GMACS[name]


def test_model_summary_leaves_a_real_model_untouched():
    model = build_model("resnet18", num_classes=10, in_channels=3, input_size=(32, 32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    summary = model_summary(model, (3, 32, 32))
    assert summary["params"] == parameter_count(model) and summary["flops_per_sample"] > 0
    assert model.training and all(t.device.type == "cpu" for t in model.state_dict().values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_reference_table_covers_every_model_and_prints(capsys):
    assert set(REFERENCE_INPUTS) == set(MODELS)  # every model has its reference input
    rows = reference_table(["simple-cnn", "unet"])
    assert rows[0]["flops_per_sample"] == count_flops(meta_model("simple-cnn", 10, 1, 28), (1, 28, 28))
    assert rows[1]["input"] == "97x192x192" and rows[1]["flops_per_sample"] > 0
    assert format_table(rows).count("\n") == len(rows) + 2
    from ddtrain import cli
    assert cli.main(["model", "flops", "resnet50v2", "--input", "3x128x128", "--classes", "10"]) == 0
    assert "resnet50v2" in capsys.readouterr().out
