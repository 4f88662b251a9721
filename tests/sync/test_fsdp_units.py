"""fsdp's wrapping policy (sync/fsdp.py ``units``): the fewest units under the size bound, consecutive
modules grouped, blocks never split, the model's ``fsdp_units`` obeyed; every parameter in one unit."""
import torch

from ddtrain.models import build_model
from ddtrain.sync.fsdp import MAX_UNIT_PARAMS, units


def sizes(groups):
    return [sum(p.numel() for m in group for p in m.parameters()) for group in groups]


def covered_once(model, groups):
    ids = [id(p) for group in groups for m in group for p in m.parameters()]
    return len(ids) == len(set(ids)) and set(ids) <= {id(p) for p in model.parameters()}


def test_resnet50_is_two_units_in_forward_order_under_the_bound():
    model = build_model("resnet50", num_classes=1000, in_channels=3, input_size=(224, 224))
    groups = units(model)
    assert sizes(groups) == [14_582_848, 10_974_184]             # 25,557,032 parameters: all of them, in 2 units
    assert sum(sizes(groups)) == sum(p.numel() for p in model.parameters())
    assert covered_once(model, groups) and all(s <= MAX_UNIT_PARAMS for s in sizes(groups))
    flat = [m for group in groups for m in group]
    assert flat == [m for m in model.children() if any(True for _ in m.parameters())]   # forward order kept


def test_a_smaller_bound_makes_more_units_and_a_block_over_it_is_one_unit_not_split():
    model = build_model("resnet50", num_classes=1000, in_channels=3, input_size=(224, 224))
    groups = units(model, max_params=4_000_000)
    assert len(groups) == 7 and covered_once(model, groups)
    over = [g for g, s in zip(groups, sizes(groups)) if s > 4_000_000]
    assert over and all(len(g) == 1 and type(g[0]).__name__ == "Block" for g in over)   # 6.04M and 4.46M blocks


def test_a_container_over_the_bound_is_split_into_its_children_and_a_large_leaf_stands_alone():
    model = build_model("vgg16", num_classes=1000, in_channels=3, input_size=(224, 224))
    groups = units(model)
    assert [type(g[0]).__name__ for g in groups] == ["Sequential", "Linear", "Linear", "Linear"]
    assert sizes(groups)[1] == 25088 * 4096 + 4096            # the 102.8M-parameter Linear: a unit of its own
    assert covered_once(model, groups)


def test_transformer_layers_are_units_whole_and_fsdp_units_overrides():
    layers = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4, batch_first=True), 5,
                                         enable_nested_tensor=False)
    groups = units(layers, max_params=10_000)                  # each layer (~83k) over the bound: not split
    assert len(groups) == 5 and all(type(g[0]).__name__ == "TransformerEncoderLayer" for g in groups)
    mlp = torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))
    assert [len(g) for g in units(mlp)] == [2]                 # both Linears in one unit; Tanh holds nothing
    mlp.fsdp_units = (torch.nn.Linear,)
    assert units(mlp) == [[mlp[0]], [mlp[2]]]
