"""Run every hostile-input case of docs/RELIABILITY.md for real and record what the user sees.

    python3 tools/hostile_cases.py [--out results/hostile] [--jobs 2] [--only SUBSTRING]

Each case is one ``ddtrain`` command (or two, for cases that need a run in progress) in a scratch
folder ``T`` built here: bad data files, image folders with links and FIFOs, checkpoint folders,
results folders. For each: the command, its exit status, the line the user sees (the error or
warning line, else the last line of output), the seconds it took, and the verdict:
``ok`` when it did what the case expects (refused with one error line and no traceback, or ran),
``silent-wrong`` when a case that must be refused ran to exit 0 without a word, ``hang`` when it
ran past its limit, ``traceback`` when a Python traceback reached the user, ``orphan`` when a process
it started (found by a variable only this case's processes inherit) is still alive 5 s after the
command returned, ``leak`` when it left a file or folder in its own ``TMPDIR`` that its output does
not name, ``data-loss`` (or another verdict) when the case's own ``check`` says so, ``unexpected`` else.
Writes ``OUT/cases.json`` (every field) and ``OUT/cases.md`` (the table RELIABILITY.md quotes).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TRAIN = ["train", "--nproc", "2", "--model", "mlp", "--epochs", "1", "--batch-size", "4", "--quiet"]
DIGITS = ["train", "--model", "mlp", "--data", "digits", "--nproc", "2"]
SMALL = ["train", "--model", "mlp", "--data", "digits", "--nproc", "1", "--batch-size", "32", "--seed", "1",
         "--quiet", "--model-arg", "hidden=16"]


@dataclass
class Case:
    group: str
    what: str                      # the input, in words
    args: list                     # ddtrain's arguments ("{T}" is the scratch folder)
    expect: str = "refused"        # refused | ok | warned
    test: str = ""                 # the test that pins it
    env: dict = field(default_factory=dict)
    limit_s: float = 180.0
    python: str | None = None      # run this Python snippet instead of ddtrain (argv after it)
    before: object = None          # callable(T) -> handle, run first (e.g. a run in progress)
    after: object = None           # callable(handle), always run
    during: object = None          # callable(proc, handle) while the command runs (e.g. SIGSTOP a worker)
    look_for: str = ""             # expect=warned/ok: a phrase that must appear
    check: object = None           # callable(T, row) -> None, or "verdict: why" (e.g. "data-loss: ...")
    judge: object = None           # callable(row, case, T, output) -> row: the case's own verdict rules, last


# ---------------------------------------------------------------- scratch inputs

def build_inputs(T: Path) -> None:
    rng = np.random.default_rng(0)
    X = rng.random((40, 6, 6))
    labels = np.arange(40) % 4

    def npz(name, **arrays):
        np.savez(T / name, **arrays)
    npz("good.npz", x=X.astype("float32"), y=labels)
    npz("float_labels.npz", x=X, y=rng.random(40) * 3)
    npz("integral_floats.npz", x=X, y=labels.astype("float64"))
    y = labels.copy(); y[17] = -1
    npz("negative.npz", x=X, y=y)
    y = np.arange(100) % 10; y[23] = 999
    npz("stray.npz", x=rng.random((100, 6, 6)), y=y)
    y = labels.copy(); y[5] = 2 ** 45
    npz("huge.npz", x=X, y=y)
    npz("gaps.npz", x=X, y=np.array([1, 2, 3, 5] * 10))
    onehot = np.eye(4)[labels]; onehot[9] = 0
    npz("onehot.npz", x=X, y=onehot)
    npz("ylabels3d.npz", x=X, y=np.zeros((40, 6, 6), dtype=np.int64))
    npz("empty.npz", x=np.zeros((0, 6, 6)), y=np.zeros(0, dtype=np.int64))
    npz("zero_size.npz", x=np.zeros((40, 0, 0)), y=labels)
    npz("strings.npz", x=np.array([["1.5"] * 6] * 40), y=labels)
    npz("bytes.npz", x=np.array([[b"ab"] * 6] * 40), y=labels)
    npz("complex.npz", x=X.astype(np.complex64), y=labels)
    np.savez(T / "objects.npz", x=X, y=np.array([{"label": 1}] * 40, dtype=object))
    npz("zero_d.npz", x=np.array(1.0), y=np.array(1))
    npz("lengths.npz", x=X, y=labels[:39])
    x = X.copy(); x[31, 0, 0] = np.nan; x[7, 1, 1] = np.inf
    npz("nan_x.npz", x=x, y=labels)
    x = X.astype("float64"); x[3, 0, 0] = 1e300
    npz("big_float64.npz", x=x, y=labels)
    npz("inf_target.npz", x=X, y=np.where(np.arange(40) == 12, -np.inf, rng.random(40)))
    # 12 samples, val_fraction 0.1: one validation sample for 2 ranks (was val_loss nan)
    npz("tiny_val.npz", x=rng.random((12, 6, 6)).astype("float32"), y=np.arange(12) % 3)
    # NaN in a row that the seeded split puts into validation
    x = rng.random((40, 6, 6)); x[:, 0, 0] = np.where(np.arange(40) == 0, np.nan, 0.5)
    npz("nan_val.npz", x=x, y=labels)
    # MNIST with damaged gzip streams
    raw_images = np.frombuffer(bytes(16) + bytes(rng.integers(0, 255, 100 * 784, dtype=np.uint8)), np.uint8)
    header_i = np.array([2051, 100, 28, 28], ">i4").tobytes()
    header_l = np.array([2049, 100], ">i4").tobytes()
    images = gzip.compress(header_i + raw_images[16:].tobytes())
    labels_gz = gzip.compress(header_l + bytes(rng.integers(0, 10, 100, dtype=np.uint8)))
    for name, data in (("flipped", None), ("cut", images[: len(images) // 2]), ("crc", None), ("html", None)):
        folder = T / f"mnist_{name}"
        folder.mkdir()
        for split in ("train", "t10k"):
            (folder / f"{split}-labels-idx1-ubyte.gz").write_bytes(labels_gz)
            body = images
            if name == "flipped":
                middle = len(images) // 2
                body = images[:middle] + bytes(b ^ 0xFF for b in images[middle:middle + 100]) + images[middle + 100:]
            elif name == "cut":
                body = data
            elif name == "crc":
                body = images[:-8] + bytes([images[-8] ^ 1]) + images[-7:]
            elif name == "html":
                body = b"<html><body>Moved</body></html>\n"
            (folder / f"{split}-images-idx3-ubyte.gz").write_bytes(body)
    # image folders
    try:
        from PIL import Image
    except ImportError:
        Image = None

    def images_in(folder, classes=("cat", "dog"), n=4):
        for c in classes:
            (folder / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                if Image is not None:
                    Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(folder / c / f"{i}.png")
        return folder
    images_in(T / "img_ok")
    (images_in(T / "parent") / "cat" / "up").symlink_to("..")
    loops = images_in(T / "loops")
    (loops / "cat" / "a").symlink_to(".")
    (loops / "cat" / "b").symlink_to(".")
    (images_in(T / "selfloop") / "dog" / "knot").symlink_to("knot")
    (images_in(T / "outside") / "cat" / "shared").symlink_to("/usr/share")
    cross = images_in(T / "cross")
    (cross / "dog" / "more").mkdir()
    (cross / "cat" / "borrowed").symlink_to(cross / "dog" / "more")
    (images_in(T / "classlink", ("dog",)) / "puppy").symlink_to("dog")
    os.mkfifo(images_in(T / "fifo") / "dog" / "stream.jpg")
    (images_in(T / "device") / "cat" / "null.jpg").symlink_to("/dev/null")
    sock_folder = images_in(T / "sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock_folder / "cat" / "s.png"))
    s.close()
    (images_in(T / "empty_img") / "cat" / "blank.jpg").write_bytes(b"")
    if Image is not None:   # issue 30: every kind of bad or unusual image in one folder, and a damaged packed set
        bad = images_in(T / "bad_images", n=6)
        (bad / "cat" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG" + bytes(range(256)) * 4)
        Image.effect_noise((64, 64), 60).convert("RGB").save(bad / "cat" / "truncated.jpg", quality=90)
        (bad / "cat" / "truncated.jpg").write_bytes((bad / "cat" / "truncated.jpg").read_bytes()[:700])
        Image.new("RGB", (32, 24), (10, 200, 30)).convert("CMYK").save(bad / "dog" / "cmyk.jpg")
        Image.new("L", (32, 24), 90).save(bad / "dog" / "grey.jpg")
        Image.new("RGB", (30, 30), (0, 0, 250)).save(bad / "dog" / "png_named.jpg", format="PNG")
        (bad / "dog" / "empty.jpg").write_bytes(b"")
        subprocess.run([sys.executable, "-m", "ddtrain", "data", "pack", str(images_in(T / "to_pack")), str(T / "packed"),
                        "--workers", "1"], check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        shard = T / "packed" / "shard-00000.bin"
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 1
        shard.write_bytes(bytes(raw))
    (images_in(T / "dangling") / "dog" / "gone.png").symlink_to("deleted.png")
    plain = images_in(T / "filelinks")
    (plain / "dog" / "link.png").symlink_to(plain / "dog" / "0.png")
    os.mkfifo(plain / "notes")
    # folders for the bad-flag rows
    (T / "D").mkdir()
    (T / "D" / "file").write_text("not a folder")


def _fingerprinted_checkpoint(T: Path) -> None:
    """D/fits: a checkpoint of a batch-64 run; D/damaged: one cut 7 bytes short (as test_faults builds them)."""
    sys.path.insert(0, str(REPO / "src"))
    from ddtrain.config import TrainConfig
    from ddtrain.reliability import checkpoint, consistency
    from ddtrain.training.build import load_and_build
    import torch
    config = TrainConfig.from_flat(model="mlp", data="digits", batch_size=64)
    data, model = load_and_build(config, meta=True)
    checkpoint.write(checkpoint.path_for(T / "D" / "fits", 7),
                     {"step": 7, "fingerprint": consistency.fingerprint(config, model, data, 2)}, {})
    path = checkpoint.write(checkpoint.path_for(T / "D" / "damaged", 3), {"step": 3}, {"w": torch.ones(3)})
    path.write_bytes(path.read_bytes()[:-7])


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1",
           # torch's compile cache where it goes without a case's own TMPDIR: kept across runs by design, no leak
           "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
               tempfile.gettempdir(), f"torchinductor_{os.environ.get('USER', 'root')}")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DDTRAIN_RUN_ID", "DDTRAIN_FAULT"):
        env.pop(name, None)
    return env


def _ddtrain(args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "ddtrain", *args], capture_output=True, text=True,
                          env={**_env(), **(env or {})}, **kw)


# ---------------------------------------------------------------- helpers for multi-step cases

def run_in_progress(T: Path, folder: str):
    """A 2-worker run that writes checkpoints 4 and 8 into T/folder, then hangs (rank 0) until killed."""
    ck = T / folder
    proc = subprocess.Popen([sys.executable, "-m", "ddtrain", *DIGITS, "--batch-size", "32", "--quiet", "--epochs", "1",
                             "--checkpoint-dir", str(ck), "--checkpoint-every", "4", "--timeout", "300"],
                            env={**_env(), "DDTRAIN_FAULT": "rank=0,step=9,kind=hang"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while not (ck / "ckpt-00000008.pt").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    return proc


MARKER_ENV = "DDTRAIN_HOSTILE_CASE"
VERDICTS = ("ok", "silent-wrong", "hang", "traceback", "data-loss", "orphan", "leak", "unexpected")


def alive_with_marker(marker: str, grace_s: float) -> list[int]:
    """Processes whose environment holds ``MARKER_ENV=marker`` still alive after ``grace_s`` (then killed)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    deadline, found = time.time() + grace_s, []
    while True:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        environ = f.read().split(b"\0")
                    state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                if needle in environ and state != "Z":
                    found.append(int(entry))
        if not found or time.time() > deadline:
            break
        time.sleep(0.25)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (torchrun starts workers in sessions of their own)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = [], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def stop_group(proc) -> None:
    if proc is None:
        return
    below = descendants(proc.pid)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


HOLDER = ("import sys, time; from ddtrain.reliability import ownership; ownership.claim(sys.argv[1], sys.argv[2]); "
          "print('held', flush=True); time.sleep(900)")


def holder(T: Path, folder: str, role: str, run_id: str, kill_first: bool = False):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(T / folder), role], stdout=subprocess.PIPE, text=True,
                            env={**_env(), "DDTRAIN_RUN_ID": run_id})
    proc.stdout.readline()
    if kill_first:
        proc.kill()
        proc.wait()
    return proc


def kill(proc) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def two_lineages(T: Path):
    for name in ("lin_a", "lin_b"):
        r = _ddtrain([*SMALL, "--epochs", "1", "--steps", "8", "--checkpoint-dir", str(T / name),
                      "--checkpoint-every", "4"])
        assert r.returncode == 0, r.stderr
    shutil.copy(T / "lin_b" / "ckpt-00000008.pt", T / "lin_a" / "ckpt-00000012.pt")


def written_checkpoint(T: Path, name: str, edit):
    folder = T / name
    r = _ddtrain([*SMALL, "--epochs", "1", "--steps", "6", "--checkpoint-dir", str(folder), "--checkpoint-every", "3"])
    assert r.returncode == 0, r.stderr
    path = folder / "ckpt-00000006.pt"
    edit(path)
    (folder / "ckpt-00000003.pt").unlink()  # the edited file is the only one: nothing to fall back on


def _resign(path: Path, payload: dict | None = None, raw: bytes | None = None, header_edit=None):
    sys.path.insert(0, str(REPO / "src"))
    from ddtrain.reliability import checkpoint
    import torch
    data = path.read_bytes()
    end = data.index(b"\n", len(checkpoint.MAGIC))
    header = json.loads(data[len(checkpoint.MAGIC):end])
    if raw is None:
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        raw = buffer.getvalue()
    header.update(payload_bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    if header_edit:
        header_edit(header)
    header["header_sha256"] = checkpoint.header_checksum(header)
    path.write_bytes(checkpoint.MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + raw)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ddtrain-hostile-pwned",))


def tiny_disk(T: Path, name: str):
    """A 64 KiB tmpfs at T/name (root only); None where it cannot be mounted."""
    folder = T / name
    folder.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True)
    return folder if r.returncode == 0 else None


def unmount(folder) -> None:
    if folder is not None:
        subprocess.run(["umount", str(folder)], capture_output=True)


def stop_worker_rank1(proc, T) -> None:
    """Once the job trains (its first checkpoint is written), SIGSTOP rank 1 for 40 s, then SIGCONT it."""
    deadline = time.time() + 240
    pid = None
    while time.time() < deadline and pid is None and proc.poll() is None:
        time.sleep(0.5)
        steps = [int(f.name[5:13]) for f in (T / "sigstop").glob("ckpt-*.pt")] if (T / "sigstop").is_dir() else []
        if max(steps, default=0) < 100:  # a few seconds into training
            continue
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"RANK=1" in env and b"HOSTILE_SIGSTOP=1" in env:
                pid = int(entry)
    if pid is None:
        print("# SIGSTOP case: rank 1 was not found training", file=sys.stderr, flush=True)
        return
    os.kill(pid, signal.SIGSTOP)
    time.sleep(40)
    os.kill(pid, signal.SIGCONT)


# ---------------------------------------------------------------- the cases

def cases() -> list[Case]:
    H = "tests/data/test_hostile_data.py::"
    out: list[Case] = []

    def data(what, spec, test, *extra, expect="refused", look_for=""):
        base = TRAIN if expect == "refused" else TRAIN[:-1]  # a run that trains shows its epoch line
        named = ("tests/data/" + test if ".py::" in test else H + test) if test else ""   # a test of another file
        out.append(Case("data", what, [*base, "--data", spec, *extra], expect, named,
                        look_for=look_for or ("Epoch 1/1" if expect == "ok" else "")))
    data("y = floats 0..3 with fractions", "npz:{T}/float_labels.npz", "test_fractional_float_labels_are_refused_unless_regression_is_said")
    data("the same with --data-arg task=regression", "npz:{T}/float_labels.npz", "test_fractional_float_labels_are_refused_unless_regression_is_said",
         "--data-arg", "task=regression", expect="ok")
    data("y = 0.0, 1.0, 2.0, 3.0 (integral floats)", "npz:{T}/integral_floats.npz", "test_integral_float_labels_are_classification", expect="ok")
    data("--data-arg task=bogus", "npz:{T}/good.npz", "test_fractional_float_labels_are_refused_unless_regression_is_said", "--data-arg", "task=bogus")
    data("a label -1 at index 17", "npz:{T}/negative.npz", "test_negative_label_is_refused")
    data("one label 999 among 0..9", "npz:{T}/stray.npz", "test_stray_label_is_refused_and_num_classes_overrides")
    data("the same with --data-arg num_classes=5", "npz:{T}/stray.npz", "test_stray_label_is_refused_and_num_classes_overrides",
         "--data-arg", "num_classes=5")
    data("the same with --data-arg num_classes=1000", "npz:{T}/stray.npz", "test_stray_label_is_refused_and_num_classes_overrides",
         "--data-arg", "num_classes=1000", expect="ok")
    data("one label 2**45 (was a 562 TB allocation)", "npz:{T}/huge.npz", "test_huge_label_is_refused_without_allocating")
    data("labels 1, 2, 3, 5 (1-based, one gap)", "npz:{T}/gaps.npz", "test_labels_with_a_few_unused_classes_are_fine", expect="ok")
    data("one-hot y with an all-zero row 9", "npz:{T}/onehot.npz", "test_one_hot_rows_must_have_exactly_one_one")
    data("y (40, 6, 6) integers with task=classification", "npz:{T}/ylabels3d.npz",
         "test_integer_labels_with_task_classification_but_wrong_shape", "--data-arg", "task=classification")
    data("x of shape (0, 6, 6)", "npz:{T}/empty.npz", "test_unusable_arrays_are_refused")
    data("x of shape (40, 0, 0) (0x0 images)", "npz:{T}/zero_size.npz", "test_unusable_arrays_are_refused")
    data("x of strings (\"1.5\")", "npz:{T}/strings.npz", "test_unusable_arrays_are_refused")
    data("x of bytes", "npz:{T}/bytes.npz", "test_unusable_arrays_are_refused")
    data("x complex", "npz:{T}/complex.npz", "test_unusable_arrays_are_refused")
    data("y an object array (a pickle)", "npz:{T}/objects.npz", "test_object_arrays_are_refused_without_unpickling")
    data("x and y 0-d", "npz:{T}/zero_d.npz", "test_unusable_arrays_are_refused")
    data("40 inputs, 39 labels", "npz:{T}/lengths.npz", "test_unusable_arrays_are_refused")
    data("NaN in x[31], inf in x[7]", "npz:{T}/nan_x.npz", "test_non_finite_inputs_name_how_many_and_the_first")
    data("NaN in a validation row", "npz:{T}/nan_val.npz", "test_non_finite_values_in_the_validation_rows_are_refused_too")
    data("1e300 in a float64 x (inf as float32)", "npz:{T}/big_float64.npz", "test_non_finite_inputs_name_how_many_and_the_first")
    data("-inf in a regression target", "npz:{T}/inf_target.npz", "test_non_finite_regression_targets_are_refused",
         "--data-arg", "task=regression")
    out.append(Case("data", "1 validation sample for 2 ranks (was val_loss nan)",
                    ["train", "--nproc", "2", "--model", "mlp", "--epochs", "1", "--batch-size", "2",
                     "--data", "npz:{T}/tiny_val.npz", "--val-fraction", "0.1"], "ok",
                    "tests/data/test_validation_metrics.py::test_fewer_validation_samples_than_ranks_give_the_exact_mean",
                    look_for="val_loss: "))
    data("missing npz file", "npz:{T}/nowhere.npz", "")
    data("a folder given as npz:FILE", "npz:{T}/D", "test_a_path_of_the_wrong_kind_is_named")
    for name, what in (("flipped", "100 bytes flipped in the images' gzip stream"), ("cut", "the images' gzip cut in half"),
                       ("crc", "one CRC bit flipped"), ("html", "an HTML page saved as the .gz")):
        data(f"mnist: {what}", f"mnist:{{T}}/mnist_{name}",
             "test_gzip_that_is_not_gzip_names_the_file" if name == "html" else f"test_damaged_gzip_names_the_file[{name}]")
    for folder, what, test in (
            ("parent", "cat/up -> .. (labelled dogs as cats)", "test_symlink_to_a_parent_folder_is_refused"),
            ("loops", "two self-links cat/a -> ., cat/b -> . (scanned forever)", "test_two_self_links_are_refused_not_scanned_forever"),
            ("selfloop", "dog/knot -> knot", "test_symlink_that_resolves_to_itself_is_refused"),
            ("outside", "cat/shared -> /usr/share", "test_folder_symlinks_out_of_the_root_or_across_classes_are_refused"),
            ("cross", "cat/borrowed -> dog/more", "test_folder_symlinks_out_of_the_root_or_across_classes_are_refused"),
            ("classlink", "a class puppy -> dog", "test_folder_symlinks_out_of_the_root_or_across_classes_are_refused"),
            ("fifo", "a FIFO dog/stream.jpg (blocked the launcher)", "test_fifo_among_the_images_is_refused_without_opening_it"),
            ("device", "cat/null.jpg -> /dev/null (a device)", "test_socket_and_device_among_the_images_are_refused"),
            ("sock", "a socket cat/s.png", "test_socket_and_device_among_the_images_are_refused"),
            ("dangling", "dog/gone.png -> deleted.png (dangling)", "test_dangling_image_symlink_is_refused")):
        data(f"imagefolder: {what}", f"imagefolder:{{T}}/{folder}", test)
    data("imagefolder: an empty cat/blank.jpg (0 bytes): skipped, named", "imagefolder:{T}/empty_img",
         "test_empty_image_file_is_skipped_and_named", "--batch-size", "2", "--data-arg", "size=16", expect="ok",
         look_for="blank.jpg: empty file")
    data("imagefolder: corrupt, truncated, CMYK, grey, PNG-in-.jpg and empty images (issue 30)", "imagefolder:{T}/bad_images",
         "test_hostile_images.py::test_training_runs_through_every_kind_of_bad_image", "--batch-size", "4",
         "--data-arg", "size=16", expect="ok",
         look_for="corrupt.jpg: unreadable image")
    data("packed: one bit of a shard flipped", "packed:{T}/packed", "test_packed.py::test_a_damaged_shard_is_refused_naming_it")
    data("imagefolder: file symlinks to images; a FIFO named notes", "imagefolder:{T}/filelinks",
         "test_plain_folder_and_file_symlinks_still_load", "--batch-size", "2", expect="ok")
    data("a file given as imagefolder:DIR", "imagefolder:{T}/good.npz", "test_a_path_of_the_wrong_kind_is_named")
    data("a file given as mnist:DIR", "mnist:{T}/good.npz", "test_a_path_of_the_wrong_kind_is_named")

    # ---- bad flags (the rows of "Bad input: refused in the parent")
    F = "tests/integration/test_faults.py::test_bad_input_is_refused_before_any_worker_starts"
    for flags in (["--checkpoint-every", "5"], ["--resume"], ["--resume", "--checkpoint-dir", "{T}/D/none"],
                  ["--checkpoint-dir", "{T}/D/fits"], ["--checkpoint-dir", "{T}/D/file"],
                  ["--resume", "--checkpoint-dir", "{T}/D/damaged"],
                  ["--resume", "--checkpoint-dir", "{T}/D/fits", "--batch-size", "16"],
                  ["--strategy", "ps-async", "--checkpoint-dir", "{T}/D/new"], ["--keep", "0"], ["--max-restarts", "-1"],
                  ["--on-nonfinite", "explode"], ["--on-mismatch", "ignore"], ["--timeout", "nan"], ["--timeout", "inf"],
                  ["--lr", "inf"], ["--weight-decay", "-0.1"], ["--seed", "-1"], ["--epochs", "-1"],
                  ["--batch-size", "0"], ["--batch-size", "x"], ["--out", "/etc/passwd/run.json"], ["--save", "{T}/D"],
                  ["--model-arg", "widht=3"], ["--data-arg", "colour=3"]):
        out.append(Case("flags", " ".join(flags), [*DIGITS, *flags], "refused", F))
    T2 = "tests/test_cli.py"
    for flags, what in ((["--nproc", "0"], None), (["--model", "nosuch"], None), (["--data", "nosuch:x"], None),
                        (["--data", "mnist:{T}/nowhere"], None), (["--lr", "-1"], None), (["--out", "x.txt"], None),
                        (["--val-fraction", "1"], None), (["--momentum", "1"], None), (["--steps", "-1"], None),
                        (["--strategy", "nosuch"], None), (["--batch-size", "100000"], "a batch larger than a shard"),
                        (["--resume-any"], None), (["--timeout", "0.000001"], "a deadline of a microsecond")):
        out.append(Case("flags", what or " ".join(flags), [*DIGITS, *flags], "refused", T2 if what is None else ""))

    # ---- one run per checkpoint directory
    O = "tests/reliability/test_ownership.py::"
    out.append(Case("ownership", "a second run --resume on the directory of a run in progress (was: both accepted)",
                    [*DIGITS, "--batch-size", "32", "--epochs", "1", "--checkpoint-dir", "{T}/busy", "--resume"],
                    "refused", O + "test_a_second_run_on_a_directory_in_use_is_refused_naming_the_owner",
                    before=lambda T: run_in_progress(T, "busy"), after=stop_group))
    out.append(Case("ownership", "the same without --resume (was: both wrote ckpt-… files over each other)",
                    [*DIGITS, "--batch-size", "32", "--epochs", "1", "--checkpoint-dir", "{T}/busy2"],
                    "refused", O + "test_a_second_run_on_a_directory_in_use_is_refused_naming_the_owner",
                    before=lambda T: run_in_progress(T, "busy2"), after=stop_group))
    out.append(Case("ownership", "a live rank-0 worker of another run (an orphan) holds the directory",
                    [*SMALL, "--epochs", "1", "--checkpoint-dir", "{T}/orphan"], "refused",
                    O + "test_a_live_rank0_worker_of_another_run_blocks_the_directory",
                    before=lambda T: holder(T, "orphan", "rank0", "orphan-run"), after=kill))
    out.append(Case("ownership", "the lock of a run killed with SIGKILL", [*SMALL, "--epochs", "1", "--steps", "6",
                    "--checkpoint-dir", "{T}/dead"], "warned", O + "test_the_lock_of_a_dead_run_is_taken_over",
                    before=lambda T: holder(T, "dead", "launcher", "crashed-run", kill_first=True), after=kill,
                    look_for="takes it over"))
    out.append(Case("ownership", "--resume onto a checkpoint another run wrote (copied in)",
                    [*SMALL, "--epochs", "1", "--steps", "16", "--checkpoint-dir", "{T}/lin_a", "--resume"], "refused",
                    O + "test_every_checkpoint_names_its_run_and_a_foreign_lineage_needs_resume_any",
                    before=two_lineages))
    out.append(Case("ownership", "the same with --resume-any",
                    [*SMALL, "--epochs", "1", "--steps", "16", "--checkpoint-dir", "{T}/lin_a", "--resume", "--resume-any"],
                    "warned", O + "test_every_checkpoint_names_its_run_and_a_foreign_lineage_needs_resume_any",
                    before=lambda T: None, look_for="--resume-any: continuing from"))

    # ---- outputs
    U = "tests/reliability/test_outputs.py::"
    out.append(Case("outputs", "--save onto the training .npz (was: the data set destroyed)",
                    [*TRAIN, "--data", "npz:{T}/good.npz", "--save", "{T}/good.npz"], "refused",
                    U + "test_save_onto_the_training_data_is_refused_and_the_data_survives"))
    out.append(Case("outputs", "--out X --save X (was: the record replaced by the model)",
                    [*DIGITS, "--out", "{T}/x.json", "--save", "{T}/x.json"], "refused",
                    U + "test_out_and_save_on_one_path_are_refused"))
    out.append(Case("outputs", "--save through a symlink onto the data", [*TRAIN, "--data", "npz:{T}/good.npz", "--save",
                    "{T}/link_to_good.npz"], "refused", U + "test_every_kind_of_clash_names_both_paths",
                    before=lambda T: (T / "link_to_good.npz").symlink_to(T / "good.npz")))
    out.append(Case("outputs", "--save inside the image folder", [*TRAIN, "--batch-size", "2", "--data", "imagefolder:{T}/img_ok",
                    "--save", "{T}/img_ok/cat/model.pt"], "refused", U + "test_every_kind_of_clash_names_both_paths"))
    out.append(Case("outputs", "--checkpoint-dir holding the data set", [*TRAIN, "--batch-size", "2",
                    "--data", "imagefolder:{T}/img_ok", "--checkpoint-dir", "{T}"], "refused", U + "test_every_kind_of_clash_names_both_paths"))
    out.append(Case("outputs", "--trace and --out one file", [*DIGITS, "--trace", "{T}/t.json", "--out", "{T}/t.json"],
                    "refused", U + "test_every_kind_of_clash_names_both_paths"))
    out.append(Case("outputs", "--save named like a checkpoint inside --checkpoint-dir",
                    [*DIGITS, "--checkpoint-dir", "{T}/ckx", "--save", "{T}/ckx/ckpt-00000001.pt"], "refused",
                    U + "test_every_kind_of_clash_names_both_paths"))
    out.append(Case("outputs", "disk full at --save (a 64 KiB tmpfs; was: model lost behind 'enforce fail')",
                    [*SMALL, "--epochs", "1", "--steps", "3", "--save", "{T}/tiny/model.pt", "--model-arg", "hidden=2048"],
                    "refused", U + "test_a_full_disk_at_the_final_save_keeps_the_model_and_says_where",
                    before=lambda T: tiny_disk(T, "tiny"), after=unmount,
                    env={"TMPDIR": "{T}"}))
    out.append(Case("outputs", "disk full at --out (a 64 KiB tmpfs, filled)",
                    [*SMALL, "--epochs", "1", "--steps", "3", "--out", "{T}/tiny2/run.json"], "warned",
                    U + "test_a_full_disk_for_the_record_keeps_it_elsewhere_with_a_warning",
                    before=lambda T: _fill(tiny_disk(T, "tiny2")), after=unmount, env={"TMPDIR": "{T}"},
                    look_for="could not write the results record"))
    out.append(Case("outputs", "umask 027: run.json mode", [], "ok", "tests/observe/test_files.py::test_outputs_respect_the_umask",
                    python="import os, stat, subprocess, sys; os.umask(0o027); "
                           "r = subprocess.run([sys.executable, '-m', 'ddtrain', 'train', '--model', 'mlp', '--steps', '2', "
                           "'--quiet', '--out', sys.argv[1]]); "
                           "print('run.json mode', oct(stat.S_IMODE(os.stat(sys.argv[1]).st_mode))); sys.exit(r.returncode)",
                    look_for="run.json mode 0o640"))

    # ---- checkpoints edited by hand
    E = "tests/reliability/test_checkpoint_edits.py::"
    edits = (
        ("ck_step", "header step 6 edited to 9 in place (was: trusted)",
         lambda p: p.write_bytes(p.read_bytes().replace(b'"step": 6', b'"step": 9', 1)), E + "test_a_header_edited_in_place_is_detected"),
        ("ck_json", "header JSON broken by an edit", lambda p: p.write_bytes(p.read_bytes().replace(b'"step": 6', b'"step": 6,,', 1)),
         E + "test_a_broken_header_line_names_the_json_problem"),
        ("ck_ranks", "payload re-signed without the ranks' parts (was: KeyError 'ranks')",
         lambda p: _resign(p, {"format": 1, "step": 6, "shared": None}),
         E + "test_a_payload_without_the_training_state_is_refused_naming_the_file"),
        ("ck_pickle", "payload re-signed as a pickle that runs a command",
         lambda p: _resign(p, raw=__import__("pickle").dumps({"w": _Evil()}, protocol=2)),
         E + "test_torch_load_refusal_is_one_whole_sentence"),
        ("ck_cut", "the only checkpoint cut in half", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
         "tests/reliability/test_checkpoint.py::test_truncated_checkpoint_is_detected_and_the_previous_one_used"),
        ("ck_flip", "one payload bit flipped", lambda p: _flip(p),
         "tests/reliability/test_checkpoint.py::test_every_kind_of_damage_is_detected"),
    )
    for folder, what, edit, test in edits:
        out.append(Case("checkpoint", what, [*SMALL, "--epochs", "1", "--steps", "9", "--checkpoint-dir", f"{{T}}/{folder}",
                                              "--resume"], "refused", test,
                        before=lambda T, folder=folder, edit=edit: written_checkpoint(T, folder, edit)))

    # ---- report
    R = "tests/report/test_report_hostile.py::"
    out.append(Case("report", "a run.json cut in half (was: 'no results')", ["report", "{T}/rep_cut"], "refused",
                    R + "test_a_truncated_run_json_is_named_as_damaged", before=lambda T: _report_folder(T, "rep_cut", "cut")))
    out.append(Case("report", "a .json that is not JSON", ["report", "{T}/rep_text"], "refused",
                    R + "test_a_file_that_is_not_json_at_all", before=lambda T: _report_folder(T, "rep_text", "text")))
    out.append(Case("report", "a cut run.json next to a good record", ["report", "{T}/rep_mixed"], "warned",
                    R + "test_a_truncated_run_json_is_named_as_damaged", before=lambda T: _report_folder(T, "rep_mixed", "mixed"),
                    look_for="skipped"))
    out.append(Case("report", "no matplotlib, a result that needs a plot (was: exit 2, '--plot needs matplotlib')",
                    ["{T}/rep_plot"], "warned", R + "test_without_matplotlib_the_report_has_its_tables_and_says_how_to_get_the_plots",
                    python="import sys; sys.modules['matplotlib'] = None; from ddtrain.cli import main; "
                           "sys.exit(main(['report', *sys.argv[1:]]))",
                    before=lambda T: _report_folder(T, "rep_plot", "plot"), look_for="pip install 'ddtrain[report]'"))
    out.append(Case("report", "no matplotlib, right after the demo (records only)", ["{T}/rep_good"], "ok",
                    R + "test_right_after_the_demo_without_matplotlib",
                    python="import sys; sys.modules['matplotlib'] = None; from ddtrain.cli import main; "
                           "sys.exit(main(['report', *sys.argv[1:]]))",
                    before=lambda T: _report_folder(T, "rep_good", "good")))
    out.append(Case("report", "a folder that does not exist", ["report", "{T}/nowhere"], "refused", ""))

    # ---- waits
    out.append(Case("waits", "rank 1 of 3 stopped with SIGSTOP for 40 s, --timeout 120 (was: 300 s of silence)",
                    ["train", "--model", "mlp", "--data", "digits", "--nproc", "3", "--batch-size", "8", "--epochs", "60",
                     "--timeout", "120", "--quiet", "--checkpoint-dir", "{T}/sigstop", "--checkpoint-every", "10"], "warned",
                    "tests/reliability/test_silent_rank.py::test_a_stopped_rank_is_named_while_the_job_waits",
                    env={"HOSTILE_SIGSTOP": "1"}, during=stop_worker_rank1, before=lambda T: T, look_for="has been silent for", limit_s=300))
    out.append(Case("waits", "DDTRAIN_SILENT_S=soon", ["train", "--model", "mlp", "--data", "digits", "--nproc", "2",
                    "--steps", "4", "--quiet"], "warned", "", env={"DDTRAIN_SILENT_S": "soon"},
                    look_for="DDTRAIN_SILENT_S='soon' is not a positive number"))
    # issue 32's round: the cases of each area, in tools/hostile_r3_<area>.py (each a cases() of its own)
    import importlib
    for area in ROUND3:
        path = Path(__file__).with_name(f"hostile_r3_{area}.py")
        if path.exists():
            sys.path.insert(0, str(path.parent))
            out += importlib.import_module(path.stem).cases()
    return out


ROUND3 = ("checkpoint", "launch", "training", "cli")


def _fill(folder):
    if folder is not None:
        try:
            with open(folder / "filler", "wb") as f:
                f.write(b"\0" * (1 << 20))
        except OSError:
            pass
    return folder


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))


def _report_folder(T: Path, name: str, kind: str) -> None:
    folder = T / name
    folder.mkdir()
    record = T / "record.json"
    if not record.exists():
        r = _ddtrain(["train", "--model", "mlp", "--steps", "3", "--quiet", "--out", str(record)])
        assert r.returncode == 0, r.stderr
    text = record.read_text()
    if kind in ("cut", "mixed"):
        (folder / "run.json").write_text(text[: len(text) // 2])
    if kind in ("mixed", "good", "plot"):
        (folder / "workers1.json").write_text(text)
    if kind == "text":
        (folder / "notes.json").write_text("not json, but a note\n")
    if kind == "plot":
        (folder / "collectives.json").write_text(json.dumps({"world_size": 2, "backend": "gloo", "device": "cpu",
            "rows": [{"algorithm": "ring", "bytes": 1024, "time_us": 50.0, "busbw_GBps": 0.02}]}))


# ---------------------------------------------------------------- running

def run_case(i: int, case: Case, T: Path) -> dict:
    fill = lambda a: a.replace("{T}", str(T))  # noqa: E731
    args = [fill(a) for a in case.args]
    env = {**_env(), **{k: fill(v) for k, v in case.env.items()}}
    # the case's own TMPDIR (what it leaves there is a leak unless its output names it) and a marker
    # every process it starts inherits (one still alive after it returned is an orphan)
    tmp = Path(tempfile.mkdtemp(prefix=f"case{i}-", dir=T))
    marker = f"{i}-{os.getpid()}-{time.monotonic_ns()}"
    env.setdefault("TMPDIR", str(tmp))
    env[MARKER_ENV] = marker
    handle = case.before(T) if case.before else None
    if case.python:
        argv = [sys.executable, "-c", case.python, *args]
        shown_command = f"python -c \"{case.python[:60]}...\" {' '.join(args)}".replace(str(T), "T")
        if not args and "umask" in case.python:
            argv.append(str(T / "umask" / "run.json"))
    else:
        argv = [sys.executable, "-m", "ddtrain", *args]
        shown_command = ("ddtrain " + " ".join(args)).replace(str(T), "T")
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, cwd=T)
    if case.during:
        import threading
        threading.Thread(target=case.during, args=(proc, handle), daemon=True).start()
    try:
        stdout, stderr = proc.communicate(timeout=case.limit_s)
        hung = False
    except subprocess.TimeoutExpired:
        for pid in descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        hung = True
    seconds = time.perf_counter() - started
    left = alive_with_marker(marker, grace_s=5.0)
    owner_pid = getattr(handle, "pid", None)
    if case.after:
        try:
            case.after(handle)
        except Exception:
            pass
    lines = [line for line in (stderr + stdout).splitlines() if line.strip()]
    errors = [line for line in stderr.splitlines() if "error:" in line]
    warnings = [line for line in (stderr + stdout).splitlines() if "warning:" in line or "note:" in line]
    traceback = "Traceback (most recent call last)" in stderr + stdout
    if case.expect == "refused":
        shown = errors[0] if errors else (lines[-1] if lines else "")
        if warnings and errors:  # a warning that says why (a skipped damaged file), then the error
            shown = f"{warnings[0]} ⏎ {shown}"
    else:
        hits = [line for line in (stderr + stdout).splitlines() if case.look_for and case.look_for in line]
        shown = (hits or warnings or [line for line in stdout.splitlines() if line.strip()][-1:] or [""])[0]
    code = proc.returncode
    if hung:
        verdict = "hang"
    elif traceback:
        verdict = "traceback"
    elif case.expect == "refused":
        # refused: a non-zero exit with an error line (how many lines the launcher adds is recorded in error_lines)
        verdict = "ok" if code != 0 and errors else ("silent-wrong" if code == 0 else "unexpected")
    else:
        found = not case.look_for or any(case.look_for in line for line in lines)
        verdict = "ok" if code == 0 and found else "unexpected"
        if case.expect == "warned" and case.group == "outputs" and "--save" in " ".join(case.args):
            verdict = "ok" if code != 0 and found else verdict
    output = stdout + stderr
    leaked = sorted(p.name for p in tmp.iterdir() if p.name not in output) if tmp.is_dir() else []
    if verdict == "ok" and left:
        verdict = "orphan"
    elif verdict == "ok" and leaked:
        verdict = "leak"
    shutil.rmtree(tmp, ignore_errors=True)
    text = shown.replace(str(T), "T")
    if owner_pid:
        text = text.replace(f"pid {owner_pid} ", "pid P ").replace(f"kill {owner_pid}", "kill P")
    row = {"id": i, "group": case.group, "input": case.what, "command": shown_command, "expect": case.expect,
            "exit": code, "shown": text, "first_line": (lines[0] if lines else "").replace(str(T), "T"),
            "seconds": round(seconds, 2), "verdict": verdict, "traceback": traceback, "hang": hung, "test": case.test,
            "error_lines": len(errors), "orphans": len(left), "leaked": leaked,
            "stderr_lines": [line.replace(str(T), "T") for line in stderr.splitlines() if line.strip()][:12]}
    if case.check and row["verdict"] == "ok":
        found = case.check(T, row)
        if found:
            row["verdict"], row["why"] = found.split(":", 1)[0].strip(), found.split(":", 1)[-1].strip()
    if case.judge:
        row = case.judge(row, case, T, output)
        if row["verdict"] == "ok" and left:    # what the marker found (and killed) counts after any judge
            row["verdict"] = "orphan"
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "results" / "hostile"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default="", help="cases whose group or input contains this (comma: any of)")
    args = parser.parse_args()
    T = Path(tempfile.mkdtemp(prefix="ddtrain-hostile-"))
    build_inputs(T)
    _fingerprinted_checkpoint(T)
    (T / "umask").mkdir()
    wanted = args.only.split(",")
    todo = [(i, c) for i, c in enumerate(cases(), 1) if any(w in c.what or w == c.group for w in wanted)]
    print(f"# {len(todo)} cases in {T}", flush=True)
    results = []
    # cases with a run in progress or a stopped rank run alone; the rest in parallel
    alone = [(i, c) for i, c in todo if c.before or c.during]
    rest = [(i, c) for i, c in todo if not (c.before or c.during)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for row in pool.map(lambda ic: run_case(ic[0], ic[1], T), rest):
            results.append(row)
            print(f"{row['id']:>3} {row['verdict']:<12} {row['exit']:>3} {row['seconds']:>6.1f}s {row['input'][:50]}: "
                  f"{row['shown'][:110]}", flush=True)
    for i, c in alone:
        row = run_case(i, c, T)
        results.append(row)
        print(f"{row['id']:>3} {row['verdict']:<12} {row['exit']:>3} {row['seconds']:>6.1f}s {row['input'][:50]}: "
              f"{row['shown'][:110]}", flush=True)
    results.sort(key=lambda r: r["id"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {v: sum(r["verdict"] == v for r in results) for v in VERDICTS}
    meta = {"cases": len(results), "summary": summary, "python": sys.version.split()[0],
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cores": os.cpu_count(),
            "command": "python3 tools/hostile_cases.py" + (f" --only {args.only}" if args.only else "")}
    (out / "cases.json").write_text(json.dumps({"meta": meta, "cases": results}, indent=1) + "\n")
    rows = ["| # | group | input | what the user sees | exit | s | verdict | test |", "|---:|---|---|---|---:|---:|---|---|"]
    for r in results:
        cell = r["shown"].replace("|", "\\|")
        rows.append(f"| {r['id']} | {r['group']} | {r['input'].replace('|', '/')} | `{cell}` | {r['exit']} | "
                    f"{r['seconds']:.1f} | {r['verdict']} | {('`' + r['test'].split('/')[-1] + '`') if r['test'] else ''} |")
    (out / "cases.md").write_text("\n".join(rows) + "\n")
    print(f"# {meta['cases']} cases: {summary}", flush=True)
    shutil.rmtree(T, ignore_errors=True)
    return 0 if summary["ok"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
