"""Every setting that changes training says so in its field's metadata: ranks must agree on it, and a resume rule.

``reliability.consistency`` derives from these marks what ranks compare at start-up and what a
checkpoint must share with the run that resumes it, so an unmarked setting that changes
training would go unchecked. Here each setting is perturbed from a small base run, one at a
time, to a valid other value (with the context that makes it act: ``lr_gamma`` under a step
schedule), three optimizer updates of a small MLP are trained in this process, and a setting
whose perturbation changes the final parameters or the number of updates must be marked.
Settings one process cannot exercise are listed with the reason; a new setting fails the test
until it is in one of the two tables.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from ddtrain import fit
from ddtrain.config import AGREE_WORDS, RESUME_WORDS, SECTIONS, TrainConfig
from ddtrain.reliability import consistency
from ddtrain.training.build import load_and_build

BASE = dict(model="mlp", model_args={"hidden": (16,)}, data="synthetic:mnist", data_args={"samples": 96, "size": 8},
            epochs=1, batch_size=32, lr=0.05, momentum=0.9, seed=3, val_fraction=0.0, quiet=True)

# setting -> (its perturbed value, settings that make it act, given to both runs)
PERTURB = {
    "model": ("simple-cnn", {"model_args": {}}), "model_args": ({"hidden": (24,)}, {}),
    "strategy": ("ring", {}), "epochs": (2, {}), "steps": (2, {}), "seed": (4, {}), "amp": ("bf16", {}),
    "channels_last": (True, {}), "compile_options": ("default", {}), "log_every": (1, {}), "quiet": (False, {}),
    "out": ("{tmp}/run.json", {}), "save": ("{tmp}/model.pt", {}),
    # data
    "data": ("synthetic:cifar10", {}), "data_args": ({"samples": 128, "size": 8}, {}), "val_fraction": (0.25, {}),
    "sharding": ("contiguous", {}), "loader_workers": (1, {}), "data_on_device": ("no", {}),
    # recipe
    "batch_size": (16, {}), "global_batch_size": (64, {}), "grad_accum": (3, {"batch_size": 8}), "lr": (0.1, {}),
    "scale_lr": ("linear", {}), "lr_reference_batch": (128, {"scale_lr": "linear"}), "lr_schedule": ("cosine", {}),
    "lr_warmup_steps": (1, {}), "lr_warmup_epochs": (0.5, {}), "lr_gamma": (0.5, {"lr_schedule": "step"}),
    "lr_step_epochs": (0.4, {"lr_schedule": "step"}), "lr_milestones": ("0.5", {"lr_schedule": "multistep"}),
    "momentum": (0.5, {}), "weight_decay": (0.01, {}), "decay_exclude": ("norms-biases", {"weight_decay": 0.01}),
    "optimizer": ("adam", {}), "clip_grad": (0.01, {}), "label_smoothing": (0.1, {}),
    # reliability, measurement, tracking: written alongside training
    "checkpoint_dir": ("{tmp}/ckpt", {}), "checkpoint_every": (1, {"checkpoint_dir": "{tmp}/ckpt"}),
    "keep": (1, {"checkpoint_dir": "{tmp}/ckpt"}), "on_nonfinite": ("skip", {}), "on_mismatch": ("rebroadcast", {}),
    "checkpoint_sync": (True, {"checkpoint_dir": "{tmp}/ckpt"}), "preempt_signal": ("USR1", {"checkpoint_dir": "{tmp}/ckpt"}),
    "requeue": (True, {"checkpoint_dir": "{tmp}/ckpt"}),
    "profile": (True, {}), "trace": ("{tmp}/trace.json", {}), "monitor_system": (True, {}),
    "monitor_every": (0.25, {"monitor_system": True}), "warmup_steps": (1, {"profile": True}),
    "csv": ("{tmp}/metrics.csv", {}), "track_every": (2, {"csv": "{tmp}/metrics.csv"}),
    "tensorboard": ("{tmp}/tb", {}),
}
NOT_PERTURBED = {
    "compile": "torch.compile on a CPU needs a C++ compiler and minutes; it changes kernels, not the arithmetic asked for",
    "resume": "needs a checkpoint to resume: tests/reliability resume and compare against uninterrupted runs",
    "resume_any": "needs another run's checkpoint (tests/reliability/test_ownership.py)",
    "resume_schedule_change": "needs a checkpoint written under other schedule settings (tests/reliability/"
                              "test_checkpoint.py: refused without it, the schedule changed with it)",
    "resume_data_change": "needs a checkpoint written on other data (tests/reliability/test_consistency_data.py: "
                          "refused without it, resumed with it)",
    "max_restarts": "read by the launcher (torchrun's agent restarts workers), not by fit",
    "preempt_grace_s": "read by the launcher (how long it lets the workers save after a stop signal), not by fit",
    "balance": "splits each global batch among the workers: one process has one share (tests/training/"
               "test_balance.py compares unequal shares with equal ones and a plain loop on 3 ranks)",
    "balance_every": "the re-measure interval of --balance: read only at world size > 1",
    "mlflow": "an optional library that logs to a tracking server (tests/observe/test_tracking.py)",
    "wandb": "an optional library that logs to a Weights & Biases run (tests/observe/test_tracking.py, offline)",
    # ddtrain.distributed: how the process joins the job, read by ddtrain.init and the launcher
    **dict.fromkeys(("backend", "timeout", "nnodes", "node_rank", "rdzv_endpoint", "skip_doctor"),
                    "read by ddtrain.init and the launcher, not by the loop"),
    # the strategy's options: at world size 1 every strategy is the single-process one, which reads none
    # (tests/sync compares them against plain loops on 2-4 ranks); all of them are marked
    **{f.name: "a strategy option: read only at world size > 1" for f in dataclasses.fields(SECTIONS["sync"])},
}


def settings():
    """{name: field} of every setting of TrainConfig, sections walked."""
    out = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name not in SECTIONS}
    for cls in SECTIONS.values():
        out.update({f.name: f for f in dataclasses.fields(cls)})
    return out


def train(tmp, changes: dict):
    values = {**BASE}
    for name, value in changes.items():
        values[name] = value.format(tmp=tmp) if isinstance(value, str) else value
    config = TrainConfig.from_flat(**values)
    data, model = load_and_build(config)
    record = fit(model, data, config)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, sum(e["steps"] for e in record["epochs"])


def same_training(a, b) -> bool:
    (pa, sa), (pb, sb) = a, b
    return sa == sb and pa.keys() == pb.keys() and all(pa[k].shape == pb[k].shape and torch.equal(pa[k], pb[k])
                                                       for k in pa)


def test_every_setting_is_perturbed_or_says_why_not():
    names = set(settings())
    assert not set(PERTURB) & set(NOT_PERTURBED)
    assert names == set(PERTURB) | set(NOT_PERTURBED), ("settings in neither table (add the new one to PERTURB, or "
                                                        f"to NOT_PERTURBED with the reason): "
                                                        f"{sorted(names - set(PERTURB) - set(NOT_PERTURBED))}")


def test_the_marks_use_the_documented_words():
    for name, f in settings().items():
        if "agree" in f.metadata or "resume" in f.metadata:
            assert f.metadata.keys() == {"agree", "resume"}, name
            assert f.metadata["agree"] in AGREE_WORDS and f.metadata["resume"] in RESUME_WORDS, name


def test_a_setting_that_changes_training_is_marked(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # ~100 runs of microseconds of arithmetic: no thread pool to wake on a busy machine
    try:
        check_every_perturbation(tmp_path)
    finally:
        torch.set_num_threads(threads)


def check_every_perturbation(tmp_path):
    if importlib.util.find_spec("tensorboard") is None:
        PERTURB.pop("tensorboard")   # the optional library is not installed: its writer cannot be made
    fields, changed, unmarked, baselines = settings(), [], [], {}
    for name, (value, context) in PERTURB.items():
        folder = tmp_path / name
        folder.mkdir()
        key = repr(sorted(context.items()))   # the unperturbed run of each context once
        before = baselines[key] = baselines.get(key) or train(folder / "a", context)
        after = train(folder / "b", {**context, name: value})
        if not same_training(before, after):
            changed.append(name)
            if "resume" not in fields[name].metadata:
                unmarked.append(name)
    assert not unmarked, f"settings that change training but carry no agree/resume metadata: {unmarked}"
    # the comparison sees what it must (else the test above proves nothing)
    assert {"model", "seed", "epochs", "data", "batch_size", "lr", "optimizer", "lr_schedule", "lr_gamma",
            "clip_grad", "label_smoothing", "grad_accum", "global_batch_size", "val_fraction", "amp"} <= set(changed)


def test_the_checked_lists_come_from_the_marks_and_hold_what_the_hand_lists_missed():
    config = TrainConfig.from_flat(**BASE)
    data, model = load_and_build(config, meta=True)
    mine = consistency.fingerprint(config, model, data, 2)
    was_agreed = ("epochs", "steps", "lr", "momentum", "weight_decay", "optimizer", "seed", "val_fraction", "sharding",
                  "amp", "sync_every", "servers", "staleness", "check_every", "checkpoint_every", "on_nonfinite",
                  "on_mismatch", "model", "strategy", "batch_size")
    missed = ("grad_accum", "global_batch_size", "compression", "lr_schedule", "clip_grad", "label_smoothing")
    assert set(was_agreed + missed) <= set(mine)
    resume = consistency.resume_fields(mine)
    assert {"world_size", "model", "model_args", "parameter_shapes", "strategy", "batch_size", "train_samples",
            "sample_shape", "seed", "sharding", "optimizer", "amp", "grad_accum", "global_batch_size"} <= set(resume)
    assert not {"lr", "epochs", "steps", "lr_schedule", "clip_grad", "label_smoothing"} & set(resume)   # may change
    elastic = consistency.resume_fields(mine, same_workers=False)
    assert {"world_size", "batch_size", "grad_accum"}.isdisjoint(elastic) and {"servers", "seed"} <= set(elastic)
    assert "data" not in mine and "train_samples" in mine   # the data set is compared by what it holds


@pytest.mark.parametrize("name", ["lr_schedule", "grad_accum", "compression"])
def test_a_resume_refuses_or_allows_as_the_mark_says(name):
    """grad_accum must match at the same worker count; lr_schedule and compression may change at a resume."""
    config = TrainConfig.from_flat(**BASE)
    data, model = load_and_build(config, meta=True)
    header = {"fingerprint": consistency.fingerprint(config, model, data, 2)}
    other = TrainConfig.from_flat(**BASE, **{"lr_schedule": {"lr_schedule": "cosine"}, "grad_accum": {"grad_accum": 2},
                                            "compression": {"compression": "fp16"}}[name])
    current = consistency.fingerprint(other, model, data, 2)
    if consistency.marked_settings(config)[name]["resume"] == "may-change":
        consistency.check_resumable(header, current, "ckpt.pt")
    else:
        with pytest.raises(consistency.ConfigMismatch, match=f"it has {name}="):
            consistency.check_resumable(header, current, "ckpt.pt")
