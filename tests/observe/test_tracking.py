"""Tracking on rank 0: TensorBoard event files read back with tensorboard's own reader, the CSV, MLflow, refusals."""
import csv
import math
import sys

import pytest

from helpers import tiny_data, tiny_model

from ddtrain import TrainConfig, fit
from ddtrain.errors import DDTrainError
from ddtrain.observe import tracking

STEPS, WARMUP, LR = 24, 6, 0.05


def run(tmp_path, **tracking_options):
    model, shape = tiny_model("mlp")
    config = TrainConfig.from_flat(model="mlp", data="synthetic", steps=STEPS, batch_size=8, grad_accum=2, lr=LR,
                                   optimizer="adamw", lr_schedule="cosine", lr_warmup_steps=WARMUP, val_fraction=0.0,
                                   quiet=True, profile=True, **tracking_options)
    return fit(model, tiny_data(shape), config)


def expected_lr(update):
    """Warm-up then cosine, written out here (update is 0-based)."""
    if update < WARMUP:
        return LR * (update + 1) / WARMUP
    return LR * 0.5 * (1 + math.cos(math.pi * (update - WARMUP) / (STEPS - WARMUP)))


def test_tensorboard_holds_the_lr_curve_and_the_metrics_and_the_csv_the_same(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    record = run(tmp_path, tensorboard=str(tmp_path / "tb"), csv=str(tmp_path / "steps.csv"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"step/loss", "step/lr", "step/samples_per_s", "step/data_s", "step/compute_s", "step/optimizer_s",
            "epoch/train_loss", "epoch/train_accuracy", "epoch/samples_per_s", "epoch/bytes_sent"} <= tags
    lr = [(e.step, e.value) for e in events.Scalars("step/lr")]
    assert [s for s, _ in lr] == list(range(1, STEPS + 1))
    for step, value in lr:
        assert math.isclose(value, expected_lr(step - 1), rel_tol=1e-6), step
    values = [v for _, v in lr]
    peak = values.index(max(values))
    assert peak == WARMUP - 1 and all(a < b for a, b in zip(values[:peak], values[1:peak + 1]))   # warm-up rises
    assert all(a >= b for a, b in zip(values[peak:], values[peak + 1:]))                            # then decays
    epoch_loss = events.Scalars("epoch/train_loss")[0].value
    assert math.isclose(epoch_loss, record["epochs"][0]["train_loss"], rel_tol=1e-6)
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    steps = [r for r in rows if r["kind"] == "step"]
    assert [int(r["step"]) for r in steps] == list(range(1, STEPS + 1))
    assert all(math.isclose(float(r["lr"]), expected_lr(int(r["step"]) - 1), rel_tol=1e-6) for r in steps)
    assert [r["kind"] for r in rows].count("epoch") == len(record["epochs"])


def test_mlflow_run_gets_the_config_and_the_metrics(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="mlflow is optional (pip install 'ddtrain[tracking]')")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")     # MLflow 3 keeps the file store behind this switch
    run(tmp_path, mlflow=True)
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert len(runs) == 1
    assert runs[0].data.params["lr_schedule"] == "cosine"
    history = mlflow.tracking.MlflowClient().get_metric_history(runs[0].info.run_id, "step_lr")
    assert math.isclose(sorted(history, key=lambda m: m.step)[0].value, expected_lr(0), rel_tol=1e-6)


def test_a_missing_library_or_an_unwritable_directory_is_one_message_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)    # import fails as if not installed
    with pytest.raises(DDTrainError, match=r"^tensorboard needs the tensorboard package: pip install 'ddtrain\[tracking\]'"):
        run(tmp_path, tensorboard=str(tmp_path / "tb"))
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(DDTrainError, match="^mlflow needs the mlflow package"):
        tracking.check(tracking.TrackingConfig(mlflow=True))
    monkeypatch.undo()
    pytest.importorskip("tensorboard")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DDTrainError, match="^tensorboard .*cannot write there"):
        tracking.check(tracking.TrackingConfig(tensorboard=str(blocker / "tb")))
