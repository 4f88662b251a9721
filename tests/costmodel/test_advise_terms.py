"""The terms the cost model learned: message schedules, the token bucket, α under load, ranks sharing a host.

Pure functions checked against hand-computed values and against ``ddtrain.comm``'s own cost formulas; the
schedules and link-sharing rules are each algorithm's own (its ``Algorithm`` record), read by name.
"""
import math

import pytest

from ddtrain import comm
from ddtrain.cluster.netns import tbf_params
from ddtrain.costmodel import schedule
from ddtrain.costmodel.burst import (TCP_PAYLOAD_SHARE, TokenBucket, burst_saving_s, emulated_burst_bytes, link_beta,
                                     transfer, transfer_time)
from ddtrain.costmodel.contention import cpu_slowdown, shared_compute_s
from ddtrain.costmodel.loaded import CommSample, allreduce_seconds, fit_loaded
from ddtrain.errors import DDTrainError

# every registered algorithm that carries both a schedule and a formula (ours: all six)
ALGORITHMS = tuple(name for name, record in comm.ALGORITHMS.items() if record.steps and record.time)


def test_every_algorithm_of_ours_carries_its_cost():
    assert set(ALGORITHMS) >= {"native", "ring", "ring-async", "tree", "butterfly", "central"}
    for name in ALGORITHMS:
        assert comm.ALGORITHMS[name].missing_cost() == [] and schedule.missing(name) == []


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("nbytes", [0, 4, 1000, 1 << 20])
def test_schedule_sums_to_the_comm_formula(algorithm, ranks, nbytes):
    # Σ(α + mβ) over the schedule = the algorithm's own formula with γ = 0 (ring-async: its β term is 2(p-1)/p·n too)
    alpha, beta = 1e-4, 1e-8
    steps = schedule.steps(algorithm, nbytes, ranks)
    formula = comm.ALGORITHMS[algorithm].time(nbytes, ranks, alpha, beta, 0.0)
    assert sum(alpha + m * beta for m in steps) == pytest.approx(formula, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("ranks", [2, 3, 4, 6, 7])
def test_the_adds_charged_under_load_are_the_formulas(algorithm, ranks):
    # with α = β = 0 (no link time) the load model's seconds are its γ term alone: the formula's
    nbytes, gamma = 1e6, 3e-9
    free = TokenBucket(burst_bytes=0, beta_s_per_byte=0.0)
    seconds = allreduce_seconds(algorithm, nbytes, ranks, alpha_s=0.0, bucket=free, gamma_s_per_byte=gamma)
    assert seconds == pytest.approx(comm.ALGORITHMS[algorithm].time(nbytes, ranks, 0.0, 0.0, gamma), rel=1e-12)


def test_added_bytes_by_hand():
    assert schedule.added_bytes("ring", 800, 4) == 600               # (p-1)/p of the buffer, added once
    assert schedule.added_bytes("tree", 800, 5) == 3 * 800           # the root adds one buffer per level
    assert schedule.added_bytes("central", 800, 4) == 3 * 800        # the root adds p-1 buffers
    # 6 ranks: the 2 extra fold their buffer into a partner (800), then a 4-rank butterfly adds 3/4 of it
    assert schedule.added_bytes("butterfly", 800, 6) == 800 + 600


def test_schedule_by_hand():
    assert schedule.steps("ring", 800, 4) == [200] * 6
    assert schedule.steps("tree", 800, 4) == [800] * 4          # 2·ceil(log2 4) levels
    assert schedule.steps("tree", 800, 5) == [800] * 6          # ceil(log2 5) = 3
    assert schedule.steps("butterfly", 800, 4) == [400, 200, 200, 400]
    assert schedule.steps("butterfly", 800, 6) == [800, 400, 200, 200, 400, 800]   # 2 extra ranks fold in and out
    assert schedule.steps("central", 800, 3) == [800] * 4


def test_schedule_refuses_unknown_and_negative():
    with pytest.raises(DDTrainError, match="carrier-pigeon.*valid: .*ring"):
        schedule.steps("carrier-pigeon", 10, 2)
    with pytest.raises(DDTrainError, match=">= 0 bytes"):
        schedule.steps("ring", -1, 2)


def test_emulated_burst_is_the_clusters():
    for rate in (50e6, 100e6, 200e6, 1e9, 10e9):
        assert emulated_burst_bytes(rate) == tbf_params(int(rate))["burst"]
    assert emulated_burst_bytes(100e6) == 65536          # 4 ms of 100 Mbit/s is 50 000 B: the 64 KiB floor
    assert emulated_burst_bytes(1e9) == 500_000          # 4 ms of 125 MB/s


def test_link_beta():
    assert link_beta(100e6) == pytest.approx(8 / (100e6 * TCP_PAYLOAD_SHARE))
    with pytest.raises(DDTrainError):
        link_beta(0)


def test_token_bucket_by_hand():
    bucket = TokenBucket(burst_bytes=1000, beta_s_per_byte=1e-3)   # 1000 B/s, 1000 B burst
    # one message of 1500 B on a full bucket: 1000 free, 500 at 1 ms each
    assert transfer_time([1500], bucket, gap_s=0.0) == pytest.approx(0.5)
    # then 600 B after 0.2 s idle: 200 tokens back -> 400 B paid
    seconds, left = transfer([1500, 600], bucket, gap_s=0.2)
    assert seconds == pytest.approx(0.5 + 0.4)
    assert left == 0
    # small messages with long gaps never pay
    assert transfer_time([300, 300, 300], bucket, gap_s=1.0) == 0.0
    # an empty bucket at the start: plain β line
    assert transfer_time([1000], bucket, gap_s=0.0, start_tokens=0) == pytest.approx(1.0)
    assert burst_saving_s([1500], bucket, gap_s=0.0) == pytest.approx(1.0)
    assert bucket.refill(100, 0.5) == 600
    assert bucket.refill(900, 5.0) == 1000


def test_cpu_slowdown_by_hand():
    assert cpu_slowdown(1, 2) == 1.0
    assert cpu_slowdown(4, 2) == 2.0
    assert cpu_slowdown(4, 2, threads_per_rank=2) == 4.0
    assert shared_compute_s(0.1, 8, 2) == pytest.approx(0.4)
    with pytest.raises(DDTrainError):
        cpu_slowdown(0, 2)


def test_link_share_by_hand():
    assert schedule.link_share("ring", 8, 2) == 1.0         # one hop per node crosses the link in a ring
    assert schedule.link_share("native", 8, 4) == 1.0       # Gloo's, modelled as a ring
    assert schedule.link_share("tree", 8, 2) == 2.0
    assert schedule.link_share("butterfly", 8, 4) == 4.0
    assert schedule.link_share("central", 8, 2) == pytest.approx(6 / 7)
    assert schedule.link_share("tree", 8, 1) == 1.0
    assert schedule.link_share("tree", 4, 4) == 1.0         # all on one node: no link crossed
    for name in ALGORITHMS:
        with pytest.raises(DDTrainError, match="divide"):
            schedule.link_share(name, 8, 3)


def test_fit_loaded_recovers_alpha_with_the_bucket():
    # times generated by the model itself (α = 3 ms, 100 Mbit/s bucket) come back
    bucket = TokenBucket.emulated(100e6)
    alpha = 3e-3
    samples = [CommSample(algorithm="ring", sizes=(n,), ranks=4, idle_s=0.05,
                          seconds=allreduce_seconds("ring", n, 4, alpha_s=alpha, bucket=bucket, idle_s=0.05))
               for n in (5e4, 8e5, 7.5e6)]
    fit = fit_loaded(samples, bucket)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert not fit.beta_fitted and fit.max_rel_residual < 1e-6


def test_fit_loaded_without_a_bucket_is_alpha_beta():
    # t = 6α + 1.5nβ for a 4-rank ring: α = 2 ms, β = 80 ns/B by hand
    samples = [CommSample(algorithm="ring", sizes=(n,), ranks=4, seconds=6 * 2e-3 + 1.5 * n * 80e-9)
               for n in (1e3, 1e5, 1e7)]
    fit = fit_loaded(samples)
    assert fit.alpha_s == pytest.approx(2e-3, rel=1e-6)
    assert fit.beta_s_per_byte == pytest.approx(80e-9, rel=1e-6)


def test_fit_loaded_two_buckets_count_both():
    # a step with two all-reduces (DDP's 1 MiB first bucket and the rest) pays 12 α on 4 ranks
    bucket = TokenBucket(burst_bytes=0, beta_s_per_byte=0.0)
    fit = fit_loaded([CommSample(algorithm="ring", sizes=(1 << 20, 3 << 20), ranks=4, seconds=0.024)], bucket)
    assert fit.alpha_s == pytest.approx(0.002)


def test_fit_loaded_refuses_bad_samples():
    with pytest.raises(DDTrainError, match="> 0 s"):
        fit_loaded([CommSample(algorithm="ring", sizes=(10,), ranks=2, seconds=0.0)] * 2)
    with pytest.raises(DDTrainError, match="at least 2"):
        fit_loaded([CommSample(algorithm="ring", sizes=(10,), ranks=2, seconds=1.0)])


def test_tree_under_the_burst_pays_only_latency():
    # why tree stayed ahead of ring far longer than α-β allows: below the burst its whole messages are free
    bucket = TokenBucket.emulated(200e6)              # 100 000 B burst
    tree = allreduce_seconds("tree", 64 << 10, 4, alpha_s=2e-3, bucket=bucket, idle_s=1.0)
    plain = comm.ALGORITHMS["tree"].time(64 << 10, 4, 2e-3, bucket.beta_s_per_byte)
    assert tree < plain
    # the first message is free; the next ones find only α's refill (2 ms at 200 Mbit/s = 50 kB)
    messages = schedule.steps("tree", 64 << 10, 4)
    refill = 2e-3 / bucket.beta_s_per_byte
    left = 100_000 - (64 << 10)
    paid = 0.0
    tokens = left
    for m in messages[1:]:
        tokens = min(100_000, tokens + refill)
        free = min(tokens, m)
        tokens -= free
        paid += (m - free) * bucket.beta_s_per_byte
    assert tree == pytest.approx(4 * 2e-3 + paid)
    assert math.isfinite(tree)
