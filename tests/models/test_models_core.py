import torch
import torch.nn as nn

from ddtrain.models import build_model, parameter_count

# Document 000, Table 6.3: layer output shapes (channels-first here) for a 28x28x1 input.
TABLE_6_3 = [(32, 26, 26), (32, 26, 26), (64, 24, 24), (64, 24, 24), (64, 12, 12), (64, 12, 12),
             (9216,), (128,), (128,), (128,), (10,)]


def test_simple_cnn_matches_table_6_3():
    model = build_model("simple-cnn", num_classes=10, in_channels=1, input_size=(28, 28))
    assert parameter_count(model) == 1_199_882
    x = torch.zeros(2, 1, 28, 28)
    shapes = []
    for layer in model:
        x = layer(x)
        shapes.append(tuple(x.shape[1:]))
    assert shapes == TABLE_6_3


def test_simple_cnn_adapts_or_refuses_other_sizes():
    model = build_model("simple-cnn", num_classes=10, in_channels=3, input_size=(32, 32))
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 10)
    import pytest
    from ddtrain.errors import DDTrainError
    with pytest.raises((ValueError, DDTrainError), match="at least 6x6"):
        build_model("simple-cnn", num_classes=10, in_channels=1, input_size=(5, 5))


def test_mlp_hidden_sizes_are_the_message_size_knob():
    small = build_model("mlp", num_classes=10, in_channels=1, input_size=(28, 28), hidden=(128, 16))
    large = build_model("mlp", num_classes=10, in_channels=1, input_size=(28, 28), hidden=(128, 1024))
    assert parameter_count(large) - parameter_count(small) == (1024 - 16) * (128 + 1 + 10)
    assert [m.out_features for m in large if isinstance(m, nn.Linear)] == [128, 1024, 10]
