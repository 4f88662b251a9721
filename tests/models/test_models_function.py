"""Each model computes what its source describes: a known-answer forward on fixed weights.

Every parameter and batch-norm statistic is set from a seeded generator (so no layer is an
identity by accident), the model runs in eval mode, and its output is compared with the same
network written here from its description (the papers' and documents' layer lists) with
``torch.nn.functional`` on the model's own weight tensors, taken in the order the layers are
registered. A residual branch multiplied by 0, a skip connection dropped, a stride misplaced
or a missing ReLU changes the output far beyond the tolerance. The deeper siblings (vgg19,
resnet152, resnet152v2) are built by the same code with more blocks; their block counts are
checked by the parameter-count tests of test_models_zoo.py.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ddtrain.models import build_model


def fixed_weights_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Seeded weights of a sensible scale (1/sqrt(fan-in)), biases and batch-norm statistics far from 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (2.0 / fan_in) ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=g))
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
    return model.eval()


class Layers:
    """The model's convolutions, batch norms and linears, handed out in registration order."""

    def __init__(self, model):
        self.queues = {kind: [m for m in model.modules() if isinstance(m, kind)]
                       for kind in (nn.Conv2d, nn.BatchNorm2d, nn.Linear)}

    def take(self, kind):
        return self.queues[kind].pop(0)

    def conv(self, x, stride=1, padding=0):
        c = self.take(nn.Conv2d)
        return F.conv2d(x, c.weight, c.bias, stride, padding)

    def bn(self, x):
        b = self.take(nn.BatchNorm2d)
        return F.batch_norm(x, b.running_mean, b.running_var, b.weight, b.bias, False, 0.0, b.eps)

    def linear(self, x):
        lin = self.take(nn.Linear)
        return F.linear(x, lin.weight, lin.bias)

    def all_used(self):
        return all(not q for q in self.queues.values())


def mlp(L, x):                       # flatten, Linear+ReLU per hidden layer, Linear
    h = x.flatten(1)
    for _ in range(2):
        h = F.relu(L.linear(h))
    return L.linear(h)


def simple_cnn(L, x):                # document 000 Table 6.3
    h = F.relu(L.conv(x))
    h = F.max_pool2d(F.relu(L.conv(h)), 2)
    return L.linear(F.relu(L.linear(h.flatten(1))))


def alexnet(L, x):                   # torchvision's AlexNet (Krizhevsky 2014 "one weird trick" widths)
    h = F.max_pool2d(F.relu(L.conv(x, 4, 2)), 3, 2)
    h = F.max_pool2d(F.relu(L.conv(h, 1, 2)), 3, 2)
    h = F.relu(L.conv(h, 1, 1))
    h = F.relu(L.conv(h, 1, 1))
    h = F.max_pool2d(F.relu(L.conv(h, 1, 1)), 3, 2)
    h = F.adaptive_avg_pool2d(h, 6).flatten(1)
    return L.linear(F.relu(L.linear(F.relu(L.linear(h)))))


def vgg16(L, x):                     # Simonyan & Zisserman configuration D
    h = x
    for convs in (2, 2, 3, 3, 3):
        for _ in range(convs):
            h = F.relu(L.conv(h, 1, 1))
        h = F.max_pool2d(h, 2)
    h = F.adaptive_avg_pool2d(h, 7).flatten(1)
    return L.linear(F.relu(L.linear(F.relu(L.linear(h)))))


def resnet_v1(blocks, bottleneck, stride_in_1x1=False):
    """He et al. 2015: conv-bn-relu, out = relu(F(x) + shortcut(x)); v1.5 strides the 3x3, v1 the first 1x1."""
    def forward(L, x):
        h = F.max_pool2d(F.relu(L.bn(L.conv(x, 2, 3))), 3, 2, 1)
        channels = 64
        for stage, count in enumerate(blocks):
            width = 64 * 2 ** stage
            out_channels = 4 * width if bottleneck else width
            for i in range(count):
                stride = 2 if i == 0 and stage > 0 else 1
                if bottleneck:
                    s1, s3 = (stride, 1) if stride_in_1x1 else (1, stride)
                    f = F.relu(L.bn(L.conv(h, s1)))
                    f = F.relu(L.bn(L.conv(f, s3, 1)))
                    f = L.bn(L.conv(f))
                else:
                    f = F.relu(L.bn(L.conv(h, stride, 1)))
                    f = L.bn(L.conv(f, 1, 1))
                shortcut = L.bn(L.conv(h, stride)) if stride != 1 or channels != out_channels else h
                h = F.relu(f + shortcut)
                channels = out_channels
        return L.linear(F.adaptive_avg_pool2d(h, 1).flatten(1))
    return forward


def resnet50v2(L, x):
    """He et al. 2016 pre-activation blocks in Keras's ResNet50V2 layout: out = shortcut + F(relu(bn(x)))."""
    h = F.max_pool2d(F.pad(L.conv(x, 2, 3), (1, 1, 1, 1)), 3, 2)
    for stage, count in enumerate((3, 4, 6, 3)):
        for i in range(count):
            stride = (2 if stage < 3 else 1) if i == count - 1 else 1
            pre = F.relu(L.bn(h))
            shortcut = L.conv(pre, stride) if i == 0 else h[:, :, ::stride, ::stride]
            f = F.relu(L.bn(L.conv(pre)))
            f = F.relu(L.bn(L.conv(f, stride, 1)))
            h = shortcut + L.conv(f)
    h = F.relu(L.bn(h))
    return L.linear(F.adaptive_avg_pool2d(h, 1).flatten(1))


def unet(L, x, depth=2):
    """Document 000 Table 6.4: (conv3-ReLU)x2 + batch norm per level, max-pool down, nearest upsample,
    conv3-ReLU halving the channels, concatenation with the skip, a 1x1 head."""
    def block(h):
        return L.bn(F.relu(L.conv(F.relu(L.conv(h, 1, 1)), 1, 1)))
    skips = []
    for _ in range(depth):
        skips.append(block(x))
        x = F.max_pool2d(skips[-1], 2)
    x = block(x)
    for skip in reversed(skips):
        x = F.relu(L.conv(F.interpolate(x, scale_factor=2, mode="nearest"), 1, 1))
        x = block(torch.cat([skip, x], 1))
    return L.conv(x)


CASES = {   # name: (builder options, input shape (C, H, W), reference)
    "mlp": (dict(num_classes=10, in_channels=1, input_size=(8, 8), hidden=(32, 16)), (1, 8, 8), mlp),
    "simple-cnn": (dict(num_classes=10, in_channels=1, input_size=(12, 12)), (1, 12, 12), simple_cnn),
    "alexnet": (dict(num_classes=10, in_channels=3, input_size=(63, 63)), (3, 63, 63), alexnet),
    "vgg16": (dict(num_classes=10, in_channels=3, input_size=(32, 32)), (3, 32, 32), vgg16),
    "resnet18": (dict(num_classes=10, in_channels=3, input_size=(32, 32)), (3, 32, 32),
                 resnet_v1([2, 2, 2, 2], False)),
    "resnet50": (dict(num_classes=10, in_channels=3, input_size=(32, 32)), (3, 32, 32),
                 resnet_v1([3, 4, 6, 3], True)),
    "resnet50 v1": (dict(num_classes=10, in_channels=3, input_size=(32, 32), version="1"), (3, 32, 32),
                    resnet_v1([3, 4, 6, 3], True, stride_in_1x1=True)),
    "resnet50v2": (dict(num_classes=10, in_channels=3, input_size=(32, 32)), (3, 32, 32), resnet50v2),
    "unet": (dict(num_classes=1, in_channels=2, input_size=(8, 8), base=4, depth=2), (2, 8, 8), unet),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_on_fixed_weights_equals_the_network_written_from_its_description(name):
    options, shape, reference = CASES[name]
    torch.manual_seed(0)
    model = fixed_weights_(build_model(name.split()[0], **options))
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(1))
    layers = Layers(model)
    with torch.no_grad():
        got, expected = model(x), reference(layers, x)
    assert layers.all_used(), f"{name}: layers the description has no place for"
    assert got.shape == expected.shape
    scale = expected.abs().max()
    assert scale > 1e-3                       # a real signal reaches the output
    assert (got - expected).abs().max() <= 1e-4 * scale, (name, (got - expected).abs().max().item(), scale.item())
    assert not torch.allclose(model(x.flip(0)), got)   # and the output depends on the input


def test_every_model_of_the_zoo_has_a_known_answer_test_or_a_sibling_with_one():
    from ddtrain.models import MODELS
    siblings = {"vgg19": "vgg16", "resnet152": "resnet50", "resnet152v2": "resnet50v2"}
    covered = {name.split()[0] for name in CASES}
    assert set(MODELS) == covered | set(siblings)
