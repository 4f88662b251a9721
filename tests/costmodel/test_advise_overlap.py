"""The overlap of DDP's bucket communication with the backward pass (``costmodel.overlap``), against hand-computed steps."""
import json

import pytest

from ddtrain import cli
from ddtrain.costmodel import advise, overlap
from ddtrain.costmodel.advise import Method, Network, Workload
from ddtrain.costmodel.burst import TokenBucket
from ddtrain.errors import DDTrainError

# reverse order: the (300 000,) vector (1.2 MB >= DDP's 1 MiB first bucket) is bucket 1, the 1000 x 1000 matrix bucket 2
SHAPES = ((1000, 1000), (300_000,))
BETA = 1e-7   # s/B: a ring of 4 sends 6 messages of n/4 bytes: 1.5 · n · β per all-reduce


def ring(compression="none"):
    return Method(strategy="ring", algorithm="ring", kind="gradient", compression=compression)


def test_ready_fractions_follow_the_parameters_in_bucket_order():
    assert overlap.ready_fractions([1, 3, 4]) == [0.125, 0.5, 1.0]
    with pytest.raises(DDTrainError, match="bucket sizes"):
        overlap.ready_fractions([0, 0])


def test_pipeline_hides_the_earlier_buckets_behind_backward():
    # backward-bound: each bucket starts when ready and is done before the next is: only the last bucket is exposed
    # (end 0.3, then max(0.3, 0.5) + 0.2 = 0.7, then max(0.7, 1.0) + 0.3 = 1.3)
    assert overlap.pipeline_end_s([0.1, 0.5, 1.0], [0.2, 0.2, 0.3]) == pytest.approx(1.3)
    assert overlap.exposed_s(1.0, [1, 4, 5], [0.2, 0.2, 0.3]) == pytest.approx(0.3)


def test_pipeline_is_the_briefs_formula_when_communication_bound():
    # max(backward until the last bucket is ready = 1.0, start 0.1 + earlier buckets 2.0) + last bucket 0.3 = 2.4
    assert overlap.pipeline_end_s([0.1, 0.5, 1.0], [1.0, 1.0, 0.3]) == pytest.approx(2.4)
    assert overlap.exposed_s(1.0, [1, 4, 5], [1.0, 1.0, 0.3]) == pytest.approx(1.4)


def test_no_backward_is_the_sequential_model():
    assert overlap.exposed_s(0.0, [1, 4, 5], [0.2, 0.5, 0.3]) == pytest.approx(1.0)


def test_predicted_step_by_hand():
    # compute 0.3 s, backward 2/3 of it = 0.2 s. Bucket 1: 300 000 elements (1.2 MB): 1.5 · 1.2e6 · β = 0.18 s, ready
    # at 0.2 · 3/13 = 0.046154 s, done at 0.226154; bucket 2: 4 MB, 0.6 s, ready at 0.2, starts at 0.226154 (bucket 1
    # still on the thread), ends 0.826154: 0.626154 s exposed after the backward pass; without overlap 0.78 s
    work = Workload(shapes=SHAPES, workers=4, batch_size=32, compute_s=0.3)
    net = Network(alpha_s=0.0, bucket=TokenBucket(burst_bytes=0, beta_s_per_byte=BETA))
    p = advise.predict(ring(), work, net)
    assert p.comm_s == pytest.approx(0.78)
    assert p.exposed_s == pytest.approx(0.2 * 3 / 13 + 0.18 + 0.6 - 0.2)
    assert p.step_s == pytest.approx(0.3 + 0.626154, abs=1e-6)
    sequential = advise.predict(ring(), work, Network(alpha_s=0.0, bucket=net.bucket, overlap=False))
    assert sequential.step_s == pytest.approx(0.3 + 0.78)
    # the old model (Network.plain) keeps no overlap
    assert advise.predict(ring(), work, net.plain(0.0)).step_s == pytest.approx(0.3 + 0.78)


def test_codec_is_shared_by_the_buckets_elements():
    # no link: the work is the codec, 0.13 s split 3:10 (0.03 s, 0.1 s); bucket 1 ends at 0.046154 + 0.03, before
    # bucket 2 is ready at 0.2: only bucket 2's 0.1 s is exposed
    work = Workload(shapes=SHAPES, workers=4, batch_size=32, compute_s=0.3)
    net = Network(alpha_s=0.0, bucket=TokenBucket(burst_bytes=0, beta_s_per_byte=0.0), codec_s={"fp16": 0.13})
    p = advise.predict(ring("fp16"), work, net)
    assert p.codec_s == pytest.approx(0.13)
    assert p.step_s == pytest.approx(0.4)


def test_local_sgd_keeps_the_sequential_model():
    work = Workload(shapes=SHAPES, workers=4, batch_size=32, compute_s=0.3)
    net = Network(alpha_s=0.0, bucket=TokenBucket(burst_bytes=0, beta_s_per_byte=BETA))
    m = Method(strategy="local-sgd", algorithm="ring", kind="average", sync_every=10)
    # one all-reduce of 5.2 MB every 10 steps: 1.5 · 5.2e6 · β / 10 = 0.078 s, after the step, nothing hidden
    assert advise.predict(m, work, net).step_s == pytest.approx(0.3 + 0.078)


def test_backward_share_is_checked():
    with pytest.raises(DDTrainError, match="backward share"):
        Workload(shapes=SHAPES, workers=4, batch_size=32, compute_s=0.3, backward_share=1.5)


def test_cli_backward_share(capsys):
    argv = ["advise", "--model", "resnet18", "--data", "cifar10", "--workers", "4", "--step-time", "0.3",
            "--link-rate", "1gbit", "--latency", "1ms", "--compressions", "none", "--strategies", "ddp", "--json", "-"]
    steps = {}
    for share in ("0", "0.6"):
        assert cli.main([*argv, "--backward-share", share]) == 0
        advice = json.loads(capsys.readouterr().out)
        assert advice["workload"]["backward_share"] == float(share)
        row = advice["ranked"][0]
        steps[share] = row["step_s"]
        if share == "0":   # nothing to hide behind: compute + all of the communication
            assert row["step_s"] == pytest.approx(0.3 + row["comm_s"])
    assert steps["0.6"] < steps["0"]
    assert cli.main([*argv, "--backward-share", "1.5"]) == 2
    assert "--backward-share" in capsys.readouterr().err
