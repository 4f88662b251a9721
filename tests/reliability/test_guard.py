"""Consistency guards on 2 Gloo ranks: configurations that differ are refused at start-up naming the
rank and the field; replicas that drift apart are caught by the parameter checksum and either
stop the run or are repaired from rank 0; non-finite steps are skipped on every rank alike."""
import torch

from multirank import run_ranks

from ddtrain.reliability import faults
from ddtrain.reliability import consistency
from ddtrain.config import TrainConfig
from ddtrain.errors import DDTrainError

BASE = dict(model="mlp", data="digits", batch_size=32, lr=0.05, seed=0, steps=6, quiet=True, val_fraction=0.2,
            model_args={"hidden": (16,)})


def fit_on_rank(per_rank: dict, fault: str | None = None):
    """Train with this rank's settings (``per_rank[rank]`` overrides BASE); the record and parameters."""
    import torch.distributed as dist
    from ddtrain.training.loop import fit
    from ddtrain.training.build import load_and_build
    rank = dist.get_rank()
    config = TrainConfig.from_flat(**{**BASE, **per_rank.get(rank, {})})
    data, model = load_and_build(config)
    faults._fault = faults._parse(fault) if fault else None
    try:
        record = fit(model, data, config)
    except DDTrainError as exc:  # raised by every rank at the same point: the group stays usable
        return f"{type(exc).__name__}: {exc}"
    finally:
        faults._fault = None
    return record["reliability"], {k: v.clone() for k, v in model.state_dict().items()}


def test_a_different_batch_size_on_one_rank_is_refused_at_start_up():
    errors = run_ranks(fit_on_rank, 2, {1: {"batch_size": 16}})
    assert errors[0].startswith("ConfigMismatch: ranks disagree on their configuration, refusing to start: "
                                "rank 1 has batch_size=16 vs 32"), errors
    assert errors[1].startswith("PeerStopped:"), errors  # rank 1 stops quietly; rank 0 speaks


def test_a_different_model_width_is_refused_at_start_up():
    message = run_ranks(fit_on_rank, 2, {1: {"model_args": {"hidden": (24,)}}})[0]
    assert "rank 1 has model_args=\"[('hidden', (24,))]\" vs \"[('hidden', (16,))]\"" in message, message
    assert "parameter_count=" in message and "parameter_shapes ('0.weight' is" not in message
    assert "parameter_shapes ('1.weight' is (24, 784) vs (16, 784))" in message, message


def test_a_diverged_replica_stops_the_run_naming_rank_and_parameter():
    # rank 1's first parameter is nudged at the start of step 2 (0-based); the check after 4 steps sees it
    errors = run_ranks(fit_on_rank, 2, {0: {"check_every": 2}, 1: {"check_every": 2}}, "rank=1,step=2,kind=corrupt")
    assert errors[0].startswith("ReplicaMismatch: replicas differ after 4 steps: rank 1 ('1.weight') differs from rank 0"), errors
    assert errors[1].startswith("PeerStopped:")


def test_rebroadcast_repairs_a_diverged_replica():
    settings = {"check_every": 2, "on_mismatch": "rebroadcast"}
    results = run_ranks(fit_on_rank, 2, {0: settings, 1: settings}, "rank=1,step=2,kind=corrupt")
    (info0, state0), (info1, state1) = results
    assert info0["rebroadcasts"] == info1["rebroadcasts"] == [4]
    assert info0["replica_checks"] == 3  # steps 2, 4, 6
    assert all(torch.equal(state0[k], state1[k]) for k in state0)


def test_a_nonfinite_step_is_skipped_on_every_rank_alike():
    settings = {"on_nonfinite": "skip"}
    results = run_ranks(fit_on_rank, 2, {0: settings, 1: settings}, "rank=1,step=3,kind=nan")
    (info0, state0), (info1, state1) = results
    assert info0["nonfinite_skipped"] == info1["nonfinite_skipped"] == [{"step": 3, "ranks": [1], "cause": "loss"}]
    assert all(torch.equal(state0[k], state1[k]) and torch.isfinite(state0[k]).all() for k in state0)


def test_fingerprint_differences_name_the_field():
    a = {"batch_size": 32, "parameter_shapes": [["w", [2, 3], "float32"]], "torch": "2.13"}
    b = {"batch_size": 32, "parameter_shapes": [["w", [2, 4], "float32"]], "torch": "2.12"}
    assert consistency.differences(a, b) == ["parameter_shapes ('w' is (2, 4) vs (2, 3))", "torch='2.12' vs '2.13'"]
    assert consistency.differences(a, dict(a)) == []
