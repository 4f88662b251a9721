"""Every data format on files in its real on-disk format, written here; corrupt files fail clearly.

CIFAR-10 batches are pickled as the python version is (protocol 2, bytes keys), ImageNet-style
folders hold JPEGs written by Pillow, NIfTI volumes are written by nibabel. Expected values come
from the arrays the test wrote (or from Pillow/numpy), never from the loaders themselves.
"""
import json
import math
import pickle
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ddtrain.data import load_dataset
from ddtrain.data.arrays import ArrayDataset
from ddtrain.data.cifar10 import load_cifar10
from ddtrain.data.imagefolder import load_imagefolder
from ddtrain.data.nifti import load_nifti
from ddtrain.data.synthetic import SHAPES, load_synthetic
from ddtrain.data.transforms import BatchDataset, random_resized_crop_box
from ddtrain.errors import DDTrainError

nib = pytest.importorskip("nibabel")
Image = pytest.importorskip("PIL.Image")


# ---------------------------------------------------------------- CIFAR-10 (python pickle batches)

def write_cifar_batch(path, n, seed, *, data=None, labels=None, drop=None):
    rng = np.random.default_rng(seed)
    batch = {b"batch_label": b"training batch", b"filenames": [b"img%d.png" % i for i in range(n)],
             b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8) if data is None else data,
             b"labels": rng.integers(0, 10, n).tolist() if labels is None else labels}
    if drop:
        del batch[drop]
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)
    return batch


@pytest.fixture
def cifar_dir(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    batches = [write_cifar_batch(root / f"data_batch_{i}", 6, i) for i in range(1, 6)]
    test = write_cifar_batch(root / "test_batch", 4, 99)
    return tmp_path, batches, test


def test_cifar10_reads_pixels_and_labels_in_file_order(cifar_dir):
    top, batches, test = cifar_dir
    ds = load_cifar10(str(top))  # finds the cifar-10-batches-py folder the archive unpacks to
    data = np.concatenate([b[b"data"] for b in batches])
    assert isinstance(ds, ArrayDataset) and len(ds) == 30 and ds.sample_shape == (3, 32, 32)
    assert ds.num_classes == 10 and ds.task == "classification"
    # row layout: 1024 red, then green, then blue values, each row-major 32x32
    i, c, h, w = 17, 2, 5, 30
    assert ds.x[i, c, h, w].item() == pytest.approx(data[i, c * 1024 + h * 32 + w] / 255)
    assert torch.equal(ds.x * 255, torch.from_numpy(data.reshape(-1, 3, 32, 32)).float())
    assert ds.y.tolist() == sum((b[b"labels"] for b in batches), [])
    assert load_cifar10(str(top), split="test").y.tolist() == test[b"labels"]


def test_cifar10_resize_matches_pillow_and_stays_lazy(cifar_dir):
    top, batches, _ = cifar_dir
    ds = load_cifar10(str(top / "cifar-10-batches-py"), resize="128")
    assert isinstance(ds, BatchDataset) and ds.sample_shape == (3, 128, 128) and len(ds) == 30
    x, y = ds.batch(torch.tensor([0, 7]))
    image = batches[1][b"data"][1].reshape(3, 32, 32).transpose(1, 2, 0)  # sample 7 = batch 2, row 1
    pil = np.asarray(Image.fromarray(image).resize((128, 128), Image.BILINEAR), dtype=np.float32) / 255
    assert np.abs(x[1].permute(1, 2, 0).numpy() - pil).max() <= 2 / 255
    assert y[1].item() == batches[1][b"labels"][1]
    data = load_dataset(f"cifar10:{top}", resize=128, val_fraction=0.2)
    assert len(data.train) == 24 and len(data.val) == 6 and data.sample_shape == (3, 128, 128)
    assert data.train.batch(torch.arange(3))[0].shape == (3, 3, 128, 128)


@pytest.mark.parametrize("damage, message", [
    ("truncate", "truncated, corrupt or not a pickle"),
    ("not-a-pickle", "truncated, corrupt or not a pickle"),
    ("no-labels", "missing key(s) ['labels']"),
    ("wrong-size", "N x 3072 uint8"),
    ("count-mismatch", "6 images but 5 labels"),
    ("bad-label", "not a CIFAR-10 class"),
    ("not-a-dict", "not the dict"),
])
def test_cifar10_damaged_batch_names_the_file(cifar_dir, damage, message):
    top, _, _ = cifar_dir
    bad = top / "cifar-10-batches-py" / "data_batch_3"
    if damage == "truncate":
        bad.write_bytes(bad.read_bytes()[:5000])
    elif damage == "not-a-pickle":
        bad.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))
    elif damage == "no-labels":
        write_cifar_batch(bad, 6, 3, drop=b"labels")
    elif damage == "wrong-size":
        write_cifar_batch(bad, 6, 3, data=np.zeros((6, 3000), np.uint8))
    elif damage == "count-mismatch":
        write_cifar_batch(bad, 6, 3, labels=[1] * 5)
    elif damage == "bad-label":
        write_cifar_batch(bad, 6, 3, labels=[1] * 5 + [10])
    else:
        bad.write_bytes(pickle.dumps([1, 2, 3], protocol=2))
    with pytest.raises(DDTrainError) as err:
        load_cifar10(str(top))
    assert str(bad) in str(err.value) and message in str(err.value)


class _Payload:
    """What a hostile 'data' file could hold: a call that runs when unpickled."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        import os
        return (os.mkdir, (self.target,))


def test_cifar10_unpickler_runs_no_code(cifar_dir):
    top, _, _ = cifar_dir
    marker = top / "pwned"
    bad = top / "cifar-10-batches-py" / "test_batch"
    bad.write_bytes(pickle.dumps({b"data": _Payload(str(marker)), b"labels": []}, protocol=2))
    with pytest.raises(DDTrainError, match="refusing to load"):
        load_cifar10(str(top), split="test")
    assert not marker.exists()


def test_cifar10_missing_batches_and_bad_split(tmp_path):
    write_cifar_batch(tmp_path / "data_batch_1", 2, 0)
    with pytest.raises(DDTrainError, match="lacks data_batch_2, data_batch_3"):
        load_cifar10(str(tmp_path))
    with pytest.raises(DDTrainError, match="unknown split"):
        load_cifar10(str(tmp_path), split="validation")
    with pytest.raises(DDTrainError, match="does not exist"):
        load_cifar10(str(tmp_path / "nowhere"))


# ---------------------------------------------------------------- ImageNet-style folders of JPEGs

COLOURS = {"cat": (200, 30, 30), "dog": (30, 200, 30), "eel": (30, 30, 200)}


@pytest.fixture
def image_dir(tmp_path):
    root = tmp_path / "imagenet"
    for split in ("train", "val"):
        for k, (name, colour) in enumerate(COLOURS.items()):
            (root / split / name).mkdir(parents=True)
            for j in range(3 if split == "train" else 1):
                size = (40 + 7 * j, 30 + 5 * k)
                Image.new("RGB", size, colour).save(root / split / name / f"{name}_{j}.JPEG", quality=100)
    Image.new("L", (20, 20), 128).save(root / "train" / "dog" / "grey.png")  # greyscale -> RGB
    return root


def test_imagefolder_classes_labels_and_transforms(image_dir):
    ds = load_imagefolder(str(image_dir), size=16, normalize=False)  # auto: the train/ split
    assert ds.classes == ["cat", "dog", "eel"] and ds.num_classes == 3 and len(ds) == 10
    assert ds.sample_shape == (3, 16, 16) and ds.task == "classification"
    torch.manual_seed(0)
    for i in range(len(ds)):
        x, label = ds[i]
        assert x.shape == (3, 16, 16) and x.dtype == torch.float32
        name = ds.classes[label]
        expect = torch.tensor((128,) * 3 if "grey" in ds.files[i] else COLOURS[name]) / 255
        assert ds.files[i].startswith(name + "/")
        # a solid JPEG: any crop or flip of it is the colour again (JPEG rounding aside)
        assert torch.allclose(x.mean((1, 2)), expect, atol=4 / 255)
    val = load_imagefolder(str(image_dir), size=16, split="val")
    assert len(val) == 3 and val.labels.tolist() == [0, 1, 2]


def test_imagefolder_flip_crop_and_eval_centre_crop(tmp_path):
    # left half black, right half white: a flip swaps the halves; the eval crop is deterministic
    (tmp_path / "a").mkdir()
    pixels = np.zeros((64, 96, 3), np.uint8)
    pixels[:, 48:] = 255
    Image.fromarray(pixels).save(tmp_path / "a" / "halves.png")
    ds = load_imagefolder(str(tmp_path), size=32, normalize=False)
    torch.manual_seed(1)
    signs = set()
    for _ in range(30):
        x, _ = ds[0]
        signs.add(int(torch.sign(x[0, :, -1].mean() - x[0, :, 0].mean())))
    assert {-1, 1} <= signs  # dark-to-bright (as stored) and bright-to-dark (flipped) both occur
    x, _ = ds.eval_view()[0]
    # resize short side 64 -> 32/0.875, centre crop 32: the crop covers 56 of the 96 columns
    reference = np.asarray(Image.fromarray(pixels).resize((round(96 * 32 / 56), 32 * 64 // 56), Image.BILINEAR))
    top, left = (reference.shape[0] - 32) // 2, (reference.shape[1] - 32) // 2
    reference = reference[top:top + 32, left:left + 32].transpose(2, 0, 1) / 255
    assert np.abs(x.numpy() - reference).mean() < 0.03
    assert torch.equal(x, ds.eval_view()[0][0])


def test_random_resized_crop_box_stays_in_range():
    gen = torch.Generator().manual_seed(0)
    for width, height in [(500, 375), (64, 64), (1000, 20)]:
        for _ in range(200):
            left, top, right, bottom = random_resized_crop_box(width, height, gen)
            assert 0 <= left < right <= width and 0 <= top < bottom <= height
            w, h = right - left, bottom - top
            if (width, height) != (1000, 20):  # that one takes the fallback: its centre 4:3 crop
                assert 0.08 * width * height * 0.95 <= w * h <= width * height
                assert 3 / 4 - 0.05 <= w / h <= 4 / 3 + 0.05
            else:
                assert (w, h) == (27, 20)


def test_imagefolder_split_gives_eval_view_for_validation(image_dir):
    data = load_dataset(f"imagefolder:{image_dir}", size=16, val_fraction=0.3)
    assert len(data.train) == 7 and len(data.val) == 3 and data.num_classes == 3
    assert data.train.train and not data.val.train
    loader = torch.utils.data.DataLoader(data.train, batch_size=4)
    x, y = next(iter(loader))
    assert x.shape == (4, 3, 16, 16) and y.dtype == torch.int64


@pytest.mark.parametrize("damage", ["truncated", "not-an-image"])
def test_imagefolder_unreadable_image_names_the_file(image_dir, damage):
    bad = image_dir / "train" / "eel" / "eel_1.JPEG"
    if damage == "truncated":
        big = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(big).save(bad, quality=90)
        bad.write_bytes(bad.read_bytes()[:600])
    else:
        bad.write_text("this is not a JPEG")
    ds = load_imagefolder(str(image_dir), size=16)
    with pytest.raises(DDTrainError) as err:
        ds[ds.files.index("eel/eel_1.JPEG")]
    assert str(bad) in str(err.value) and "unreadable image" in str(err.value)


def test_imagefolder_layout_errors(tmp_path):
    (tmp_path / "empty_class").mkdir()
    with pytest.raises(DDTrainError, match="empty_class holds no images"):
        load_imagefolder(str(tmp_path))
    with pytest.raises(DDTrainError, match="no class sub-folders"):
        load_imagefolder(str(tmp_path / "empty_class"))
    with pytest.raises(DDTrainError, match="no val/ sub-folder"):
        load_imagefolder(str(tmp_path), split="val")


# ---------------------------------------------------------------- NIfTI volumes written by nibabel

GRID = (10, 12, 8)


def _volume(rng, shape, affine, path):
    data = rng.normal(5.0, 2.0, shape).astype(np.float32)
    data[:2] = 0  # background, as after skull stripping
    nib.save(nib.Nifti1Image(data, affine), str(path))
    return data


@pytest.fixture
def nifti_dir(tmp_path):
    """Two subjects, each a 4-D 'dwi' (3 volumes), a 3-D 'fa' and a 3-D 't1' target."""
    rng = np.random.default_rng(0)
    affine = np.diag([1.25, 1.25, 1.25, 1.0])
    volumes = {}
    for subject in ("sub-01", "sub-02"):
        (tmp_path / subject).mkdir()
        volumes[subject] = [_volume(rng, GRID + (3,), affine, tmp_path / subject / "dwi.nii.gz"),
                            _volume(rng, GRID, affine, tmp_path / subject / "fa.nii"),
                            _volume(rng, GRID, affine, tmp_path / subject / "t1.nii.gz")]
    return tmp_path, volumes


def _reference(volume, axis, pad):
    """numpy reference: z-score over nonzero voxels, slice, centre zero-pad."""
    out = np.zeros_like(volume)
    inside = volume != 0
    out[inside] = (volume[inside] - volume[inside].mean()) / volume[inside].std()
    slices = np.moveaxis(out, axis, 0)
    h, w = slices.shape[1:]
    padded = np.zeros((len(slices), pad, pad), np.float32)
    padded[:, (pad - h) // 2:(pad - h) // 2 + h, (pad - w) // 2:(pad - w) // 2 + w] = slices
    return padded


def test_nifti_subject_folders_4d_channels_and_zscore(nifti_dir):
    root, volumes = nifti_dir
    ds = load_nifti(str(root), inputs="dwi,fa", target="t1", pad=16, axis=0)
    assert isinstance(ds, ArrayDataset) and ds.task == "regression" and ds.num_classes is None
    assert ds.x.shape == (20, 4, 16, 16) and ds.y.shape == (20, 1, 16, 16)
    dwi, fa, t1 = volumes["sub-02"]
    second = slice(10, 20)  # sub-02's slices follow sub-01's
    for c in range(3):
        np.testing.assert_allclose(ds.x[second, c].numpy(), _reference(dwi[..., c], 0, 16), atol=1e-5)
    np.testing.assert_allclose(ds.x[second, 3].numpy(), _reference(fa, 0, 16), atol=1e-5)
    np.testing.assert_allclose(ds.y[second, 0].numpy(), _reference(t1, 0, 16), atol=1e-5)
    axial = load_nifti(str(root), inputs=["dwi", "fa"], target="t1", pad=12, axis="axial", norm="none")
    assert axial.x.shape == (16, 4, 12, 12)  # 8 axial slices of 10x12 per subject
    np.testing.assert_array_equal(axial.y[3, 0, 1:11].numpy(), volumes["sub-01"][2][:, :, 3])


def test_nifti_manifests_json_and_csv_agree_with_patterns(nifti_dir):
    root, _ = nifti_dir
    by_pattern = load_nifti(str(root), inputs="dwi,fa", target="t1", pad=16, axis=0)
    (root / "subjects.json").write_text(json.dumps(
        {s: {"inputs": [f"{s}/dwi.nii.gz", f"{s}/fa.nii"], "target": f"{s}/t1.nii.gz"} for s in ("sub-01", "sub-02")}))
    csv_rows = ["subject,inputs,target"] + [f"{s},{s}/dwi.nii.gz;{s}/fa.nii,{s}/t1.nii.gz" for s in ("sub-01", "sub-02")]
    (root / "manifest.csv").write_text("\n".join(csv_rows) + "\n")
    for spec in (root / "subjects.json", root):  # a manifest file, or DIR holding manifest.csv
        ds = load_nifti(str(spec), pad=16, axis=0)
        assert torch.equal(ds.x, by_pattern.x) and torch.equal(ds.y, by_pattern.y)


def test_nifti_axis_names_follow_the_affine(tmp_path):
    rng = np.random.default_rng(1)
    swapped = np.array([[0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]], float)  # voxel axis 2 is L-R
    for name in ("a", "b"):
        _volume(rng, GRID, swapped, tmp_path / f"{name}.nii.gz")
    assert nib.aff2axcodes(swapped) == ("S", "A", "R")
    sagittal = load_nifti(str(tmp_path), inputs="a", target="b", pad=12, axis="sagittal")
    assert sagittal.x.shape == (GRID[2], 1, 12, 12)
    assert load_nifti(str(tmp_path), inputs="a", target="b", pad=12, axis="axial").x.shape[0] == GRID[0]


def test_nifti_crop_and_average_pool(nifti_dir):
    root, volumes = nifti_dir
    cropped = load_nifti(str(root / "sub-01"), inputs="fa", target="t1", pad=8, crop=True, axis=0, norm="none")
    np.testing.assert_array_equal(cropped.y[:, 0].numpy(), volumes["sub-01"][2][:, 2:10, :])
    pooled = load_nifti(str(root / "sub-01"), inputs="fa", target="t1", pad=16, size=4, axis=0, norm="none")
    full = load_nifti(str(root / "sub-01"), inputs="fa", target="t1", pad=16, axis=0, norm="none")
    np.testing.assert_allclose(pooled.y.numpy(), full.y.numpy().reshape(10, 1, 4, 4, 4, 4).mean((3, 5)), rtol=1e-6)


@pytest.mark.parametrize("damage, message", [
    ("truncated", "truncated or corrupt NIfTI data"),
    ("garbage", "not a readable NIfTI volume"),
    ("other-grid", "differs from the target"),
    ("other-shape", "differs from the target"),
])
def test_nifti_damaged_or_misregistered_volume_names_the_file(nifti_dir, damage, message):
    root, _ = nifti_dir
    bad = root / "sub-02" / "dwi.nii.gz"
    rng = np.random.default_rng(2)
    if damage == "truncated":
        bad.write_bytes(bad.read_bytes()[:2000])
    elif damage == "garbage":
        bad.write_bytes(b"\x1f\x8b" + bytes(100))
    elif damage == "other-grid":
        _volume(rng, GRID + (3,), np.diag([1.0, 1.0, 1.0, 1.0]), bad)
    else:
        _volume(rng, (10, 12, 9, 3), np.diag([1.25, 1.25, 1.25, 1.0]), bad)
    with pytest.raises(DDTrainError) as err:
        load_nifti(str(root), inputs="dwi,fa", target="t1", pad=16)
    assert str(bad) in str(err.value) and message in str(err.value)


def test_nifti_option_and_layout_errors(nifti_dir, monkeypatch):
    root, _ = nifti_dir
    with pytest.raises(DDTrainError, match="larger than pad=8"):
        load_nifti(str(root), inputs="dwi", target="t1", pad=8, axis=0)
    with pytest.raises(DDTrainError, match="matches 2 files"):
        load_nifti(str(root / "sub-01"), inputs="*.nii.gz", target="t1")
    with pytest.raises(DDTrainError, match="matches no NIfTI file"):
        load_nifti(str(root), inputs="md", target="t1")
    with pytest.raises(DDTrainError, match="inputs=PATTERN"):
        load_nifti(str(root))
    with pytest.raises(DDTrainError, match="unknown slice axis 'oblique'"):
        load_nifti(str(root), inputs="fa", target="t1", axis="oblique")
    monkeypatch.setitem(sys.modules, "nibabel", None)  # as if the imaging extra were not installed
    with pytest.raises(DDTrainError, match=r"pip install ddtrain\[imaging\]"):
        load_nifti(str(root), inputs="fa", target="t1")


# ---------------------------------------------------------------- synthetic stand-ins

def test_synthetic_exact_shapes_of_the_real_datasets():
    for name, (channels, side, classes, samples) in SHAPES.items():
        ds = load_synthetic(name, lazy=True)
        assert len(ds) == samples and ds.sample_shape == (channels, side, side) and ds.num_classes == classes
        x, y = ds.batch(torch.tensor([0, samples - 1]))
        assert x.shape == (2, channels, side, side) and x.dtype == torch.float32
        assert y.shape == ((2,) if classes else (2, 1, side, side))
    imagenet = load_synthetic("imagenet")
    assert isinstance(imagenet, BatchDataset) and len(imagenet) == 1_281_167  # lazy: no pixels stored
    assert sum(t.numel() for t in vars(imagenet.make).values() if torch.is_tensor(t)) < 1_000_000
    assert isinstance(load_synthetic("mnist", samples=100), ArrayDataset)  # small ones are materialised


def test_synthetic_is_a_deterministic_function_of_seed_and_index():
    lazy = load_synthetic("cifar10", samples=64, size="16", lazy="true")
    eager = load_synthetic("cifar10", samples=64, size=16)
    idx = torch.tensor([5, 63, 0])
    assert torch.equal(lazy.batch(idx)[0], eager.x[idx]) and torch.equal(lazy.batch(idx)[1], eager.y[idx])
    assert torch.equal(lazy[63][0], eager.x[63]) and torch.equal(lazy.select(idx).batch(torch.tensor([1]))[0][0], eager.x[63])
    moved = lazy.select(idx).to("cpu")  # the GPU-resident path, exercised on the CPU here
    assert moved.device == torch.device("cpu") and torch.equal(moved.batch(torch.tensor([2]))[0][0], eager.x[0])
    other = load_synthetic("cifar10", samples=64, size=16, data_seed=1)
    assert not torch.equal(other.x, eager.x)
    labels = load_synthetic("imagenet", samples=20_000, size=8, lazy=True).batch(torch.arange(20_000))[1]
    assert len(labels.unique()) == 1000  # every class occurs
    data = load_dataset("synthetic:hcp", samples=10, size=16, channels=3, val_fraction=0.2)
    assert isinstance(data.train, ArrayDataset) and len(data.train) == 8 and data.sample_shape == (3, 16, 16)
    assert data.task == "regression" and data.num_classes is None


def test_synthetic_classification_is_learnable(one_thread):
    ds = load_synthetic("cifar10", samples=448, size=8)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x_val, y_val = ds.x[384:], ds.y[384:]
    accuracy = [(model(x_val).argmax(1) == y_val).float().mean().item()]
    for _ in range(2):
        for s in range(0, 384, 32):
            loss = F.cross_entropy(model(ds.x[s:s + 32]), ds.y[s:s + 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
    accuracy.append((model(x_val).argmax(1) == y_val).float().mean().item())
    assert accuracy[0] < 0.3 and accuracy[1] > 0.6, accuracy  # chance is 0.1


def test_synthetic_hcp_target_is_a_smooth_function_of_the_channels():
    x, y = load_synthetic("hcp", samples=4, size=32, channels=5).batch(torch.arange(4))
    inside = y[:, 0] != 0
    assert 0.5 < inside.float().mean() < 0.9  # a head-shaped region, zero background
    # atanh(target) is linear in the channels: least squares recovers it almost exactly
    features = x.permute(0, 2, 3, 1)[inside].double()
    goal = torch.atanh(y[:, 0][inside].double().clamp(-0.999999, 0.999999))
    solution = torch.linalg.lstsq(features, goal[:, None]).solution
    residual = (features @ solution)[:, 0] - goal
    assert residual.pow(2).mean() < 1e-3 * goal.var()


def test_synthetic_option_errors():
    with pytest.raises(DDTrainError, match="valid: cifar10, hcp, imagenet, mnist"):
        load_synthetic("svhn")
    with pytest.raises(DDTrainError, match="size='big' is not an integer"):
        load_synthetic("mnist", size="big")
    with pytest.raises(DDTrainError, match="regression dataset"):
        load_synthetic("hcp", classes=3)
    with pytest.raises(DDTrainError, match="samples=0 must be at least 1"):
        load_synthetic("mnist", samples=0)
    assert math.isfinite(load_synthetic("mnist", samples=3).x.sum().item())
