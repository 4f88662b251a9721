"""Document 000 §6.1.1's pipeline on the real MNI152 volumes in ../shared/data/brain.

Inputs are the grey- and white-matter maps, the target T1 (the end-to-end task: T1 from
tissue maps). Expected values are computed here from nibabel's arrays with numpy.
"""
import functools
import json

import numpy as np
import pytest
import torch

from ddtrain.data import load_dataset
from ddtrain.data.arrays import ArrayDataset
from ddtrain.data.brain import SliceOptions, Subject, iter_slices, read_manifest, slice_subjects, subject_slices
from ddtrain.errors import DDTrainError

nib = pytest.importorskip("nibabel")
SHAPE = (197, 233, 189)  # x (R-L), y (A-P), z (S-I), 1 mm


@pytest.fixture
def subject(brain_dir):
    files = {kind: next(brain_dir.glob(f"mni_icbm152_{kind}_*.nii.gz")) for kind in ("gm", "wm", "t1")}
    return Subject("mni152", [files["gm"], files["wm"]], files["t1"])


def _zscored(path):
    volume = np.asarray(nib.load(str(path)).dataobj, dtype=np.float64)
    inside = volume != 0
    volume[inside] = (volume[inside] - volume[inside].mean()) / volume[inside].std()
    return volume


def test_real_volumes_share_a_grid(subject):
    images = [nib.load(str(f)) for f in [*subject.inputs, subject.target]]
    assert all(image.shape == SHAPE for image in images)
    assert nib.aff2axcodes(images[0].affine) == ("R", "A", "S")


@functools.lru_cache(maxsize=1)
def _full_resolution(subject_files, axis):
    """Every slice at full resolution, padded to 240x240 (computed once per axis and test run)."""
    *inputs, target = subject_files
    return subject_slices(Subject("mni152", list(inputs), target), SliceOptions(axis=axis, pad=240))


def full_resolution(subject, axis="sagittal"):
    return _full_resolution((*subject.inputs, subject.target), axis)


@pytest.mark.parametrize("axis, count, plane", [("coronal", 233, (197, 189)), ("axial", 189, (197, 233)),
                                                ("sagittal", 197, (233, 189))])  # sagittal last: kept for the next tests
def test_slice_count_and_padding_along_each_axis(subject, axis, count, plane):
    x, y = full_resolution(subject, axis)
    assert x.shape == (count, 2, 240, 240) and y.shape == (count, 1, 240, 240)
    # the data lie in the centred plane[0] x plane[1] box; everything around it is zero padding
    top, left = (240 - plane[0]) // 2, (240 - plane[1]) // 2
    box = torch.zeros(240, 240, dtype=torch.bool)
    box[top:top + plane[0], left:left + plane[1]] = True
    for volume in (x, y):
        assert volume[:, :, ~box].abs().max() == 0 and volume[:, :, box].abs().max() > 0


def test_sagittal_slices_match_a_numpy_reference(subject):
    """z-score within the nonzero (brain) voxels, sagittal slice, zero-pad 233x189 -> 240x240."""
    x, y = full_resolution(subject)
    for channel, path in enumerate([*subject.inputs, subject.target]):
        reference = _zscored(path)
        got = (x[:, channel] if channel < 2 else y[:, 0]).numpy()
        np.testing.assert_allclose(got[:, 3:236, 25:214], reference, atol=1e-4)


def test_zscore_is_per_channel_over_the_brain(subject):
    x, y = full_resolution(subject)
    raw = [np.asarray(nib.load(str(f)).dataobj) for f in [*subject.inputs, subject.target]]
    for channel, values in enumerate([x[:, 0], x[:, 1], y[:, 0]]):
        inside = values[values != 0].double()
        assert inside.numel() == np.count_nonzero(raw[channel])  # background stays exactly 0
        assert abs(inside.mean().item()) < 1e-4 and abs(inside.std().item() - 1) < 1e-4
    whole, _ = subject_slices(subject, SliceOptions(pad=240, size=80, step=20, norm="volume"))
    assert whole.shape == (10, 2, 80, 80)
    assert whole[:, 0].min() < 0  # background is no longer 0 when the whole volume is scaled
    pooled, _ = subject_slices(subject, SliceOptions(pad=240, size=80, step=20))
    reference = x[::20].reshape(10, 2, 80, 3, 80, 3).mean((3, 5))  # average pooling 240 -> 80
    assert torch.allclose(pooled, reference, atol=1e-5)


def test_default_pad_192_refuses_larger_slices_unless_cropping(subject):
    with pytest.raises(DDTrainError) as err:
        subject_slices(subject)  # document 000's defaults: sagittal, 192x192
    assert str(subject.inputs[0]) in str(err.value) and "233x189" in str(err.value)
    x, y = subject_slices(subject, SliceOptions(crop=True, step=60))
    assert x.shape == (4, 2, 192, 192)
    reference = _zscored(subject.target)[0::60, 20:212, :]  # rows 233 -> 192 centred; cols 189 padded
    np.testing.assert_allclose(y[:, 0, :, 1:190].numpy(), reference, atol=1e-4)
    assert y[:, 0, :, [0, 190, 191]].abs().max() == 0


def test_manifest_lists_subjects_and_slices_stack(subject, tmp_path):
    manifest = tmp_path / "subjects.json"
    manifest.write_text(json.dumps([{"subject": "mni", "inputs": [str(p) for p in subject.inputs],
                                     "target": str(subject.target)}]))
    (listed,) = read_manifest(manifest)
    assert listed.inputs == subject.inputs and listed.target == subject.target
    x, y = slice_subjects([listed, listed], pad=240, size=48, step=4, drop_empty=True)  # two subjects, stacked
    assert x.shape[1:] == (2, 48, 48) and y.shape[1:] == (1, 48, 48) and len(x) % 2 == 0
    half = len(x) // 2
    assert torch.equal(x[:half], x[half:]) and torch.equal(y[:half], y[half:])
    pairs = list(iter_slices([listed], SliceOptions(pad=240, size=48, step=4, drop_empty=True)))
    assert len(pairs) == half and all(torch.equal(p[0], x[i]) for i, p in enumerate(pairs))
    assert pairs[0][0].shape == (2, 48, 48) and pairs[0][1].shape == (1, 48, 48)


def test_t1_is_learnable_from_tissue_maps(brain_dir, one_thread):
    """A tiny conv net fitted on these slices halves its validation loss: the pipeline's pairs line up."""
    data = load_dataset(f"nifti:{brain_dir}", inputs="gm,wm", target="t1", pad=240, size=24,
                        drop_empty=True, val_fraction=0.2, seed=0)
    assert len(data.train) + len(data.val) == 145  # sagittal slices holding any T1 voxel
    assert isinstance(data.train, ArrayDataset) and data.task == "regression" and data.num_classes is None
    assert data.sample_shape == (2, 24, 24) and data.train.y.shape[1:] == (1, 24, 24)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 16, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 1, 3, padding=1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def val_loss():
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(data.val.x), data.val.y).item()

    losses = [val_loss()]
    for _ in range(6):
        order = torch.randperm(len(data.train))
        for s in range(0, len(order) - 15, 16):
            x, y = data.train.batch(order[s:s + 16])
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(val_loss())
    assert losses[-1] < 0.5 * losses[0], losses
