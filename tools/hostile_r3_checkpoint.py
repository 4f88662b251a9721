"""Issue 32's hostile cases of checkpoint files, checkpoint-directory locks and settings files (round 3), for
tools/hostile_cases.py's table.

    python3 tools/hostile_r3_checkpoint.py [--only SUBSTRING] [--out results/hostile_r3_checkpoint]

``cases()`` gives the rows (``hostile_cases.Case``); ``before`` builds each case's input in the scratch folder T
(a long run's checkpoints, a lock that is a link, a FIFO or a folder, a record of a two-node job, files nested
100,000 deep). The 5,000-epoch case trains for a few minutes; the rest take seconds each.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from hostile_cases import REPO, SMALL, Case, _env, kill, run_case, written_checkpoint

H = "tests/reliability/test_checkpoint_header.py::"
I = "tests/reliability/test_checkpoint_info.py::"
O = "tests/reliability/test_ownership.py::"
C = "tests/cli/test_config_files.py::"
ONE_STEP = ["train", "--model", "mlp", "--data", "npz:{T}/one_step.npz", "--batch-size", "32", "--val-fraction", "0",
            "--quiet", "--model-arg", "hidden=8", "--checkpoint-dir", "{T}/long"]


# ---------------------------------------------------------------- inputs

def _src() -> None:
    if str(REPO / "src") not in sys.path:
        sys.path.insert(0, str(REPO / "src"))


def _ddtrain(args, env=None):
    return subprocess.run([sys.executable, "-m", "ddtrain", *args], capture_output=True, text=True,
                          env={**_env(), **(env or {})})


def long_run(T: Path):
    """5,000 one-step epochs with a checkpoint at each epoch's end (was: every header past the reader's limit)."""
    import numpy as np
    rng = np.random.default_rng(0)
    np.savez(T / "one_step.npz", x=rng.random((32, 4, 4)).astype("float32"), y=np.arange(32) % 3)
    r = _ddtrain([a.replace("{T}", str(T)) for a in ONE_STEP] + ["--epochs", "5000"])
    assert r.returncode == 0, r.stderr[-2000:]


def _split(path: Path):
    _src()
    from ddtrain.reliability import checkpoint
    data = path.read_bytes()
    end = data.index(b"\n", len(checkpoint.MAGIC))
    return json.loads(data[len(checkpoint.MAGIC):end]), data[end + 1:]


def _rewrite(path: Path, header: dict, payload: bytes, *, sign: bool) -> None:
    from ddtrain.reliability import checkpoint
    header = {k: v for k, v in header.items() if k != "header_sha256"}
    if sign:   # as a forger would: only what the case is about is wrong
        header["header_sha256"] = checkpoint.header_checksum(header)
    path.write_bytes(checkpoint.MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload)


def step_edited_checksum_deleted(path: Path) -> None:
    header, payload = _split(path)
    _rewrite(path, {**header, "step": 3}, payload, sign=False)


def two_mb_header(path: Path) -> None:
    header, payload = _split(path)
    _rewrite(path, {**header, "note": "x" * 2_000_000}, payload, sign=True)


def nested_header(path: Path) -> None:
    header, payload = _split(path)
    line = json.dumps(header)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path.write_bytes(b"DDTRAIN-CHECKPOINT 1\n" + line.encode() + b"\n" + payload)


def wrong_type(path: Path) -> None:
    header, payload = _split(path)
    _rewrite(path, {**header, "elastic": {**(header.get("elastic") or {}), "worker_counts": 3}}, payload, sign=True)


def lock_is(T: Path, folder: str, kind: str):
    ck = T / folder
    ck.mkdir()
    lock = ck / ".ddtrain-lock"
    if kind == "symlink":
        (T / "precious.txt").write_text("the only copy\n")
        lock.symlink_to(T / "precious.txt")
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    return T


def precious_kept(T: Path) -> None:
    text = (T / "precious.txt").read_text()
    if text != "the only copy\n":   # the data-loss half of the case, said where the table's line is read
        print(f"# DATA LOSS: {T / 'precious.txt'} now holds {text[:80]!r}", file=sys.stderr, flush=True)


HOLDER = ("import sys, time; from ddtrain.reliability import ownership; ownership.claim(sys.argv[1], 'launcher'); "
          "print('held', flush=True); time.sleep(900)")


def sweep_holder(T: Path):
    """A launching process of run 'sweep-7' (the id a sweep script exported) holding T/sweep."""
    env = {**_env(), "DDTRAIN_RUN_ID": "sweep-7", "DDTRAIN_LAUNCH_ID": ""}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(T / "sweep")], stdout=subprocess.PIPE, text=True,
                            env=env)
    proc.stdout.readline()
    return proc


def fifo_checkpoint(T: Path, folder: str) -> None:
    """T/folder: a run's checkpoints 2 and 4, and a FIFO named like a newer one."""
    r = _ddtrain([*SMALL, "--epochs", "1", "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir",
                  str(T / folder)])
    assert r.returncode == 0, r.stderr
    os.mkfifo(T / folder / "ckpt-00000099.pt")


def record(T: Path, name: str, world_size, **dist) -> None:
    _src()
    from ddtrain.config import TrainConfig
    config = TrainConfig.from_flat(model="mlp", data="digits", steps=2, quiet=True, model_args={"hidden": (8,)}, **dist)
    (T / name).write_text(json.dumps({"config": config.as_dict(), "world_size": world_size}))


def settings_files(T: Path) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    (T / "deep.toml").write_text(f"lr = {deep}\n")
    (T / "deep.yaml").write_text(f"lr: {deep}\n")
    (T / "deep.json").write_text('{"config": ' + deep + "}")
    (T / "latin1.toml").write_bytes('model = "caf\u00e9"\n'.encode("latin-1"))
    os.mkfifo(T / "fifo.toml")


# a poller: `checkpoint info` run again and again on a directory a run writes and rotates (--keep 2, every step)
POLL = """
import subprocess, sys, time
folder = sys.argv[1]
train = subprocess.Popen([sys.executable, "-m", "ddtrain", "train", "--model", "mlp", "--data", "digits", "--steps",
                          "100000", "--checkpoint-every", "1", "--keep", "2", "--quiet", "--checkpoint-dir", folder,
                          "--model-arg", "hidden=8"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    polls, damaged, gone = 0, 0, 0
    deadline = time.time() + 60
    while time.time() < deadline and polls < 12:
        r = subprocess.run([sys.executable, "-m", "ddtrain", "checkpoint", "info", folder], capture_output=True,
                           text=True, timeout=60)
        if "no checkpoint files" in r.stderr:
            time.sleep(0.5)
            continue
        polls += 1
        damaged += r.stdout.count("DAMAGED")
        gone += r.stdout.count("integrity:     gone")
        if "Traceback" in r.stderr:
            print(r.stderr, file=sys.stderr)
finally:
    train.terminate()   # a clean stop: a SIGKILLed launcher leaves its folders to the next launch's sweep
    try:
        train.wait(timeout=60)
    except subprocess.TimeoutExpired:
        train.kill()
        train.wait()
print(f"checkpoint info polled {polls} times during rotation: damaged: {damaged}, gone while read: {gone}")
sys.exit(0 if polls and not damaged else 1)
"""

INFO_FIFO = """
import subprocess, sys
r = subprocess.run([sys.executable, "-m", "ddtrain", "checkpoint", "info", sys.argv[1]], capture_output=True,
                   text=True, timeout=120)
print(r.stderr, file=sys.stderr)
lines = [line for line in r.stdout.splitlines() if "integrity" in line or line.startswith("#")]
print("\\n".join(lines))
sys.exit(0 if r.returncode == 1 and "it is a FIFO (named pipe)" in r.stdout else 1)
"""


# ---------------------------------------------------------------- the cases

def cases() -> list[Case]:
    out: list[Case] = []
    out.append(Case("checkpoint", "5,000 one-step epochs, then --resume (was: every header past the reader's limit, "
                    "resumed 2,500 epochs back)", [*ONE_STEP, "--epochs", "5001", "--resume"], "ok",
                    H + "test_the_header_does_not_grow_with_the_epochs_and_a_resume_keeps_the_history",
                    before=long_run, limit_s=900, look_for="ckpt-00005000.pt at step 5000"))
    edits = (
        ("ck2mb", "a whole checkpoint with a 2 MB header: checkpoint info (was: 'truncated inside its header')",
         two_mb_header, "ok", H + "test_a_whole_checkpoint_with_a_2_mb_header_is_read", "integrity:     ok"),
        ("cknosum", "header step 6 -> 3 with its checksum field deleted (was: integrity ok, resumed at step 3)",
         step_edited_checksum_deleted, "refused", H + "test_a_header_whose_checksum_was_deleted_is_damaged", ""),
        ("ckdeep", "a header nested 100,000 deep (was: RecursionError)", nested_header, "refused",
         H + "test_a_header_nested_100000_deep_is_damaged_not_a_recursion_error", ""),
        ("cktype", "a header whose elastic.worker_counts is 3 (re-signed; was: TypeError)", wrong_type, "refused",
         H + "test_header_fields_of_the_wrong_type_are_damaged_not_a_traceback", ""),
    )
    for folder, what, edit, expect, test, look_for in edits:
        args = (["checkpoint", "info", f"{{T}}/{folder}/ckpt-00000006.pt"] if expect == "ok" else
                [*SMALL, "--epochs", "1", "--steps", "9", "--checkpoint-dir", f"{{T}}/{folder}", "--resume"])
        out.append(Case("checkpoint", what, args, expect, test, look_for=look_for,
                        before=lambda T, folder=folder, edit=edit: written_checkpoint(T, folder, edit)))
    out.append(Case("checkpoint", "the newest checkpoint is a FIFO, --resume (was: the launcher blocked opening it)",
                    [*SMALL, "--epochs", "1", "--steps", "6", "--checkpoint-every", "2", "--checkpoint-dir",
                     "{T}/ck_fifo", "--resume"], "warned", H + "test_the_command_resumes_past_a_fifo_in_one_line_each",
                    before=lambda T: fifo_checkpoint(T, "ck_fifo"), limit_s=120,
                    look_for="is damaged (not a checkpoint: it is a FIFO"))
    out.append(Case("checkpoint", "checkpoint info on a directory holding a FIFO (was: blocked for ever)",
                    ["{T}/ck_fifo_info"], "ok", I + "test_info_on_a_directory_holding_a_fifo_is_one_answer_not_a_hang",
                    python=INFO_FIFO, before=lambda T: fifo_checkpoint(T, "ck_fifo_info"), limit_s=150,
                    look_for="it is a FIFO (named pipe)"))
    out.append(Case("checkpoint", "checkpoint info polled for 60 s while a run rotates (--keep 2, every step; was: a "
                    "good checkpoint called damaged)", ["{T}/ck_rotating"], "ok",
                    I + "test_a_checkpoint_rotated_away_while_the_directory_is_read_is_gone_not_damaged",
                    python=POLL, before=lambda T: T, limit_s=150, look_for="damaged: 0"))

    # ---- the directory's lock
    out.append(Case("ownership", "DIR/.ddtrain-lock a symlink to another file (was: that file overwritten)",
                    [*SMALL, "--epochs", "1", "--steps", "2", "--checkpoint-dir", "{T}/lock_link"], "refused",
                    O + "test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_kept",
                    before=lambda T: lock_is(T, "lock_link", "symlink"), after=precious_kept))
    out.append(Case("ownership", "DIR/.ddtrain-lock a FIFO (was: the launcher blocked opening it)",
                    [*SMALL, "--epochs", "1", "--steps", "2", "--checkpoint-dir", "{T}/lock_fifo"], "refused",
                    O + "test_a_lock_file_that_is_a_fifo_or_a_folder_is_one_line_not_a_hang",
                    before=lambda T: lock_is(T, "lock_fifo", "fifo"), limit_s=120))
    out.append(Case("ownership", "DIR/.ddtrain-lock a folder (was: IsADirectoryError)",
                    [*SMALL, "--epochs", "1", "--steps", "2", "--checkpoint-dir", "{T}/lock_dir"], "refused",
                    O + "test_a_lock_file_that_is_a_fifo_or_a_folder_is_one_line_not_a_hang",
                    before=lambda T: lock_is(T, "lock_dir", "folder")))
    out.append(Case("ownership", "a second run on a directory in use, both with DDTRAIN_RUN_ID=sweep-7 (was: both "
                    "accepted, both wrote)", [*SMALL, "--epochs", "1", "--steps", "2", "--checkpoint-dir", "{T}/sweep",
                                              "--resume"], "refused",
                    O + "test_two_launches_that_share_an_exported_run_id_are_two_runs",
                    env={"DDTRAIN_RUN_ID": "sweep-7", "DDTRAIN_LAUNCH_ID": ""}, before=sweep_holder, after=kill))

    # ---- settings files and replays
    out.append(Case("config", "--config naming a FIFO (was: blocked for ever)", ["train", "--config", "{T}/fifo.toml"],
                    "refused", C + "test_a_fifo_given_as_a_settings_file_is_one_line_not_a_hang",
                    before=settings_files, limit_s=60))
    for name, what in (("deep.toml", "--config TOML nested 100,000 deep"), ("deep.yaml", "--config YAML nested "
                       "100,000 deep"), ("latin1.toml", "--config in Latin-1, not UTF-8")):
        test = "test_a_file_that_is_not_utf8_is_one_line_naming_it" if "latin" in name else \
            "test_a_file_nested_100000_deep_is_one_line_naming_it"
        out.append(Case("config", f"{what} (was: a traceback not naming the file)", ["train", "--config", f"{{T}}/{name}"],
                        "refused", C + test, before=lambda T: (T / "deep.toml").exists() or settings_files(T)))
    out.append(Case("config", "--config-from JSON nested 100,000 deep (was: RecursionError)",
                    ["train", "--config-from", "{T}/deep.json"], "refused",
                    C + "test_a_file_nested_100000_deep_is_one_line_naming_it",
                    before=lambda T: (T / "deep.toml").exists() or settings_files(T)))
    out.append(Case("config", "--config-from a 2-node record on one machine (was: waited for the other node, "
                    "ignored SIGTERM)", ["train", "--config-from", "{T}/two_nodes.json"], "warned",
                    C + "test_the_command_replays_a_two_node_record_here_instead_of_waiting",
                    before=lambda T: record(T, "two_nodes.json", 2, nnodes=2, node_rank=0,
                                            rdzv_endpoint="127.0.0.1:29999"),
                    look_for="a replay runs on this machine with --nproc 2", limit_s=240))
    out.append(Case("config", "--config-from a record with world_size: 0 (was: 1 worker without a word)",
                    ["train", "--config-from", "{T}/zero.json"], "refused",
                    C + "test_a_record_whose_world_size_is_not_a_worker_count_is_refused_naming_it",
                    before=lambda T: record(T, "zero.json", 0)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="cases whose group or input contains this (comma: any of)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    wanted = args.only.split(",")
    T = Path(tempfile.mkdtemp(prefix="ddtrain-hostile-r3-checkpoint-"))
    rows = []
    try:
        for i, case in enumerate(cases(), 1):
            if not any(w in case.what or w == case.group for w in wanted):
                continue
            started = time.time()
            row = run_case(i, case, T)
            rows.append(row)
            print(f"{i:>3} {row['verdict']:<12} {row['exit']:>3} {time.time() - started:>6.1f}s {case.what[:60]}: "
                  f"{row['shown'][:140]}", flush=True)
    finally:
        import shutil
        shutil.rmtree(T, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["verdict"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
