"""Issue 32's hostile cases of the training area: silent wrong results of training and resuming, and outputs.

Loaded by tools/hostile_cases.py (``ROUND3``); each case names the test that pins it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from hostile_cases import DIGITS, Case, _ddtrain, _fill, tiny_disk, unmount

ROUNDS = """
import torch, ddtrain
from torch.utils.data import DataLoader, TensorDataset
for round_ in range(3):
    ddtrain.init()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
    model, optimizer, data = ddtrain.prepare(model, optimizer, data)
    for x, y in data:
        optimizer.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); optimizer.step()
    print(f"rank {ddtrain.rank()} round {round_} done", flush=True)
    ddtrain.shutdown()
"""


def _npz(path: Path, permuted: bool) -> None:
    rng = np.random.default_rng(0)
    y = np.arange(240) % 4
    np.savez(path, x=rng.random((240, 1, 6, 6)).astype("float32"), y=np.random.default_rng(1).permutation(y) if permuted else y)


def _checkpoint_then_permute(T: Path):
    """A 3-worker run's checkpoint over T/same.npz, then T/same.npz rewritten with its labels permuted."""
    _npz(T / "same.npz", permuted=False)
    r = _ddtrain(["train", "--model", "mlp", "--data", f"npz:{T}/same.npz", "--nproc", "3", "--batch-size", "8",
                  "--steps", "4", "--quiet", "--checkpoint-dir", str(T / "permuted_ck"), "--checkpoint-every", "2"])
    assert r.returncode == 0, r.stderr
    _npz(T / "same.npz", permuted=True)


def _checkpoint_accum1(T: Path):
    r = _ddtrain([*DIGITS, "--batch-size", "32", "--steps", "10", "--quiet", "--checkpoint-dir", str(T / "accum_ck")])
    assert r.returncode == 0, r.stderr


def _csv_disk(T: Path):
    return _fill(tiny_disk(T, "csvdisk"))


def _record_and_model(T: Path, row: dict):
    missing = [name for name in ("csvdisk_run.json", "csvdisk_model.pt") if not (T / name).exists()]
    return f"data-loss: {', '.join(missing)} not written" if missing else None


def _rounds_script(T: Path):
    (T / "rounds.py").write_text(ROUNDS)


def cases() -> list:
    G = "training"
    out = [
        Case(G, "resume on 3 workers over the same file with its labels permuted (was: accepted, only sizes compared)",
             ["train", "--model", "mlp", "--data", "npz:{T}/same.npz", "--nproc", "3", "--batch-size", "8", "--steps", "8",
              "--quiet", "--checkpoint-dir", "{T}/permuted_ck", "--checkpoint-every", "2", "--resume"], "refused",
             "tests/reliability/test_consistency_data.py::test_a_resume_on_permuted_labels_is_refused_and_the_override_resumes",
             before=_checkpoint_then_permute, limit_s=240),
        Case(G, "resume with --grad-accum 2 instead of 1, no --global-batch-size (issue: 640 samples skipped)",
             [*DIGITS, "--batch-size", "32", "--epochs", "2", "--quiet", "--checkpoint-dir", "{T}/accum_ck", "--resume",
              "--grad-accum", "2"], "refused", "tests/test_config_metadata.py (grad_accum must match at the same worker count)",
             before=_checkpoint_accum1, limit_s=240),
        Case(G, "--on-nonfinite skip with every step non-finite (--lr 1e6; was: exit 0, 67 of 69 skipped, model saved)",
             [*DIGITS, "--epochs", "3", "--lr", "1e6", "--on-nonfinite", "skip", "--quiet", "--save", "{T}/nonfinite.pt"],
             "refused", "tests/reliability/test_nonfinite_bounds.py::test_every_step_non_finite_stops_after_ten_in_a_row"),
        Case(G, "--csv on a 64 KiB disk that fills up (was: the run killed, no --save, no record)",
             [*DIGITS, "--epochs", "4", "--batch-size", "16", "--quiet", "--csv", "{T}/csvdisk/m.csv", "--out",
              "{T}/csvdisk_run.json", "--save", "{T}/csvdisk_model.pt"], "warned",
             "tests/observe/test_tracking.py::test_a_csv_on_a_disk_that_fills_up_leaves_the_record_and_the_model",
             before=_csv_disk, after=unmount, look_for="could not be written", check=_record_and_model),
        Case(G, "ddtrain.init/prepare/shutdown three times in one script, 2 ranks (was: hung in the second round)",
             ["run", "--nproc", "2", "{T}/rounds.py"], "ok",
             "tests/training/test_init_rounds.py::test_three_rounds_of_init_prepare_shutdown_on_two_ranks_finish",
             before=_rounds_script, look_for="rank 1 round 2 done", limit_s=120),
    ]
    return out


if __name__ == "__main__":   # a quick look: the cases' commands
    for case in cases():
        print(case.group, "|", case.what, "|", " ".join(case.args))
    subprocess.run([sys.executable, "-c", "pass"], check=True)
