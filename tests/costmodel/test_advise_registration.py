"""An all-reduce algorithm registered from outside the package is ranked by the adviser like ours; one whose record
lacks a cost term is left out with the reason, and everything else is still ranked.

``ring2`` is ``ddtrain.comm.ring``'s functions under another name (with a DDP strategy of the same name), so every
prediction of ``ring2`` must equal ``ring``'s to the bit: the library call (``ddtrain.bench.advise``) and
``ddtrain advise`` run as a user runs it, in a fresh process that imports a plugin registering both.
"""
import json
import os
import subprocess
import sys
from functools import partial

import pytest

from ddtrain import comm
from ddtrain.bench.advise import AdviceRequest, build_advice, render
from ddtrain.comm import Algorithm, register_algorithm, ring
from ddtrain.costmodel import schedule
from ddtrain.errors import DDTrainError
from ddtrain.sync import STRATEGIES, StrategySpec, register_strategy
from ddtrain.sync.allreduce import AllReduceStrategy

# what a user writes: one record per algorithm, one per strategy (this text is also the subprocess's plugin)
PLUGIN = '''
from functools import partial
from ddtrain.comm import Algorithm, register_algorithm, ring
from ddtrain.sync import StrategySpec, register_strategy
from ddtrain.sync.allreduce import AllReduceStrategy

register_algorithm(Algorithm(name="ring2", all_reduce=ring.all_reduce, time=ring.ring_time, steps=ring.ring_steps,
                             link_share=ring.ring_link_share, summary="a copy of ring"))
register_strategy(StrategySpec(name="ring2", build=partial(AllReduceStrategy, algorithm="ring2"),
                               summary="DDP with the ring2 all-reduce", sync_in_backward=True, algorithm="ring2",
                               options=("compression",), sends="gradient"))
'''
COMPRESSIONS = "none,fp16,powersgd:4"
CODEC_S = {"fp16": 0.004, "powersgd:4": 0.03}
# 6 workers, 2 per node, γ > 0 and a token bucket: every term the adviser has (link sharing, adds, burst) is used
ARGS = {"model": "mlp", "data": "mnist", "workers": 6, "procs_per_node": 2, "step_time": "20ms",
        "compressions": COMPRESSIONS, "sync_every": "4"}
CALIBRATION = {"loaded": {"alpha_s": 0.002, "beta_s_per_byte": 8e-8, "gamma_s_per_byte": 1e-9, "burst_bytes": 65536}}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "cal.json").write_text(json.dumps(CALIBRATION))
    (tmp_path / "codec.json").write_text(json.dumps({"codec_s": CODEC_S}))
    return {"calibration": str(tmp_path / "cal.json"), "codec_times": str(tmp_path / "codec.json")}


def registered(*algorithms: Algorithm):
    """Register each algorithm and a DDP strategy of the same name that sends its gradients with it."""
    for algorithm in algorithms:
        register_algorithm(algorithm)
        register_strategy(StrategySpec(name=algorithm.name, build=partial(AllReduceStrategy, algorithm=algorithm.name),
                                       summary=f"DDP with {algorithm.name}", sync_in_backward=True,
                                       algorithm=algorithm.name, options=("compression",), sends="gradient"))


@pytest.fixture
def registry():
    """Leave ALGORITHMS and STRATEGIES as they were, whatever the test registered."""
    algorithms, strategies = dict(comm.ALGORITHMS), dict(STRATEGIES)
    yield
    for live, saved in ((comm.ALGORITHMS, algorithms), (STRATEGIES, strategies)):
        live.clear()
        live.update(saved)


def ring_copy(name: str, **without) -> Algorithm:
    fields = {"time": ring.ring_time, "steps": ring.ring_steps, "link_share": ring.ring_link_share}
    return Algorithm(name=name, all_reduce=ring.all_reduce, summary="a copy of ring",
                     **{k: v for k, v in fields.items() if k not in without})


def test_the_adviser_ranks_an_algorithm_registered_from_outside(registry, files):
    registered(ring_copy("ring2"))
    advice = build_advice(AdviceRequest(**ARGS, **files))
    rows = {r["label"]: r for r in advice["ranked"]}
    for compression in COMPRESSIONS.split(","):
        ours, theirs = rows[f"ring {compression}"], rows[f"ring2 {compression}"]
        for key in ("step_s", "comm_s", "codec_s", "exposed_s", "bytes_per_step", "collectives_per_step"):
            assert theirs[key] == ours[key], (compression, key)
        assert theirs["train_args"] == ["--strategy", "ring2", *ours["train_args"][2:]]
    assert "ring2" not in advice["inputs"]["not_predicted"]
    # the comparison means something: the ring's step pays for its link here, and differs from tree's
    assert rows["ring none"]["comm_s"] > 0 and rows["ring none"]["step_s"] != rows["tree none"]["step_s"]


def test_an_algorithm_without_a_schedule_is_left_out_with_the_reason(registry, files):
    registered(ring_copy("ring-bare", steps=None, link_share=None), ring_copy("ring-unshared", link_share=None))
    before = {r["label"] for r in build_advice(AdviceRequest(**ARGS, **files, strategies="ddp,ring,tree,local-sgd"))[
        "ranked"]}
    advice = build_advice(AdviceRequest(**ARGS, **files))
    skipped = advice["inputs"]["not_predicted"]
    assert skipped["ring-bare"] == "its algorithm ring-bare: no message schedule, no link-sharing rule"
    assert skipped["ring-unshared"] == "its algorithm ring-unshared: no link-sharing rule"
    labels = {r["label"] for r in advice["ranked"]}
    assert before <= labels and not any(label.startswith("ring-bare") for label in labels)
    table = render(advice)
    assert "# not predicted: ring-bare (its algorithm ring-bare: no message schedule, no link-sharing rule)" in table
    with pytest.raises(DDTrainError, match="ring-bare cannot be predicted .*no message schedule"):
        build_advice(AdviceRequest(**ARGS, **files, strategies="ring,ring-bare"))
    # its cost formula still serves the plain α-β model, and the record says what the adviser lacks
    assert comm.ALGORITHMS["ring-bare"].missing_cost() == ["no message schedule", "no link-sharing rule"]
    with pytest.raises(DDTrainError, match="no message schedule for algorithm 'ring-bare'"):
        schedule.steps("ring-bare", 100, 4)


def test_a_strategy_that_says_nothing_of_what_it_sends_is_left_out_named(registry, files):
    register_strategy(StrategySpec(name="mystery", build=lambda *a: None, summary="?", sync_in_backward=True,
                                   algorithm="ring"))
    register_strategy(StrategySpec(name="gossip", build=lambda *a: None, summary="?",
                                   not_predicted="gossip: not modelled"))
    skipped = build_advice(AdviceRequest(**ARGS, **files))["inputs"]["not_predicted"]
    assert skipped["gossip"] == "gossip: not modelled"
    assert "sends" in skipped["mystery"]


def test_ddtrain_advise_ranks_it_in_a_users_process(tmp_path, files):
    (tmp_path / "ring2_plugin.py").write_text(PLUGIN)
    out = tmp_path / "advice.json"
    argv = ["advise", "--model", "mlp", "--data", "mnist", "--workers", "6", "--procs-per-node", "2",
            "--step-time", "20ms", "--calibration", files["calibration"], "--codec-times", files["codec_times"],
            "--compressions", COMPRESSIONS, "--sync-every", "4", "--json", str(out)]
    code = f"import sys, ring2_plugin; from ddtrain.cli import main; sys.exit(main({argv!r}))"
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if not line.startswith("#")]
    by_label = {" ".join(r[1:3]): r[3] for r in rows}          # 'ring2 none' -> its step (ms), as printed
    assert by_label["ring2 none"] == by_label["ring none"] and by_label["ring2 fp16"] == by_label["ring fp16"]
    ranked = json.loads(out.read_text())["ranked"]
    step = {r["label"]: r["step_s"] for r in ranked}
    assert step["ring2 powersgd:4"] == step["ring powersgd:4"]
