"""The preemption component alone: handlers that only count real signals, and one answer for every rank.

A real signal (``os.kill`` of the process itself) sets the flag and nothing else; ``should_stop``
gives every participant the same answer at the same check, however many of them were signalled
(R = 3, only rank 1 signalled); the store keys of old checks are removed; a world of one needs no store.
"""
from __future__ import annotations

import os
import signal

import pytest

from ddtrain.errors import DDTrainError
from ddtrain.reliability.preemption import ALWAYS, Preemption, parse_signals
from multirank import run_ranks


def test_parse_signals_names_numbers_and_refusals():
    assert parse_signals("USR1") == ("SIGUSR1",)
    assert parse_signals("sigusr1, USR2,USR1") == ("SIGUSR1", "SIGUSR2")
    assert parse_signals(str(int(signal.SIGUSR1))) == ("SIGUSR1",)
    assert parse_signals("") == ()
    with pytest.raises(DDTrainError, match="SIGKILL cannot be caught"):
        parse_signals("KILL")
    with pytest.raises(DDTrainError, match="'BOGUS' is not a signal"):
        parse_signals("BOGUS")
    with pytest.raises(DDTrainError, match="--preempt-signal '999': no signal"):
        parse_signals("999")
    with pytest.raises(DDTrainError, match="'²' is not a signal"):   # was int('²'): '²'.isdigit() is True
        parse_signals("²")


def test_a_superscript_digit_in_torchrun_s_restart_count_is_no_count_not_a_traceback(monkeypatch):
    from ddtrain.distributed.storage import restarts_allowed
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "²")
    assert restarts_allowed(1) == 1
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", " 3 ")
    assert restarts_allowed(1) == 3


def test_a_real_signal_only_sets_the_flag_and_the_handlers_are_put_back():
    before = {name: signal.getsignal(getattr(signal, name)) for name in (*ALWAYS, "SIGUSR1")}
    with Preemption(["USR1"], participants=1) as stop:
        assert stop.signals == ("SIGTERM", "SIGINT", "SIGUSR1")
        assert not stop.should_stop() and not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)   # delivered to this (main) thread before kill returns
        os.kill(os.getpid(), signal.SIGTERM)   # a second one: counted, nothing else
        assert stop.count == 2 and stop.signal_name == "SIGUSR1"
        assert stop.should_stop() and stop.should_stop()   # stays True
    assert {name: signal.getsignal(getattr(signal, name)) for name in before} == before


def test_extra_signals_come_from_the_environment_by_default(monkeypatch):
    monkeypatch.setenv("DDTRAIN_PREEMPT_SIGNAL", "USR2")
    assert Preemption(participants=1).signals == ("SIGTERM", "SIGINT", "SIGUSR2")
    monkeypatch.setenv("DDTRAIN_PREEMPT_SIGNAL", "NOPE")
    with pytest.raises(DDTrainError, match="DDTRAIN_PREEMPT_SIGNAL 'NOPE'"):
        Preemption(participants=1)


def _ranks_stop_together(signalled_rank: int, at_check: int, checks: int, every_s: float = 0.0,
                         step_s: float = 0.0):
    """Every rank calls ``should_stop`` ``checks`` times, ``step_s`` apart; ``signalled_rank`` signals itself
    (a real SIGTERM) before call ``at_check``. Returns (answers, signalled, check keys left, checks made)."""
    import time

    import torch.distributed as dist
    from ddtrain.distributed.job import default_store
    answers = []
    with Preemption(participants=dist.get_world_size(), timeout_s=30, check_every_s=every_s,
                    name="test-together") as stop:
        for check in range(1, checks + 1):
            time.sleep(step_s * (1 + dist.get_rank()) / 2)   # ranks at different speeds, as between collectives
            if check == at_check and dist.get_rank() == signalled_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            answers.append(stop.should_stop())
        prefix = stop._prefix
    store = default_store()
    left = [check for check in range(1, checks + 1) if store.check([f"{prefix}/{check}"])]
    return answers, stop.requested, left, stop.checks


def test_three_ranks_stop_at_the_same_check_when_only_rank_1_is_signalled():
    results = run_ranks(_ranks_stop_together, 3, 1, 4, 6)   # check_every_s=0: a check at every call
    for rank, (answers, requested, _, _) in enumerate(results):
        assert answers == [False, False, False, True, True, True], (rank, answers)
        assert requested == (rank == 1)
    # the last to arrive at a check removes the previous check's keys: only the fourth's are left (no later check ran)
    assert all(left == [4] for _, _, left, _ in results), results


def test_with_checks_every_50_ms_all_ranks_still_stop_at_the_same_call_soon_after_the_signal():
    # calls 10 ms apart on rank 0 (20 and 30 ms on the others): rank 0 spaces the checks to about 50 ms
    results = run_ranks(_ranks_stop_together, 3, 1, 10, 40, 0.05, 0.02)
    firsts = {answers.index(True) + 1 for answers, _, _, _ in results}
    assert len(firsts) == 1, results                    # the same call on every rank
    first = firsts.pop()
    assert 10 <= first <= 10 + 6, results               # within about 50 ms of calls after the signal
    checks = {made for _, _, _, made in results}
    assert len(checks) == 1 and checks.pop() <= first, results   # the same checks on every rank


def _no_signal(checks: int, every_s: float):
    import torch.distributed as dist
    with Preemption(participants=dist.get_world_size(), timeout_s=30, check_every_s=every_s, name="test-none") as stop:
        return [stop.should_stop() for _ in range(checks)], stop.checks


def test_no_signal_no_stop_on_three_ranks():
    assert run_ranks(_no_signal, 3, 5, 0.0) == [([False] * 5, 5)] * 3


def test_back_to_back_boundaries_ask_the_store_twice_then_not_for_a_thousand():
    # the first check has no clock yet (the next boundary checks again); the second sees boundaries taking
    # microseconds against 10 s between checks: the most boundaries between two checks, 1000
    assert run_ranks(_no_signal, 3, 40, 10.0) == [([False] * 40, 2)] * 3


def _one_rank_missing():
    import torch.distributed as dist
    stop = Preemption(participants=dist.get_world_size(), timeout_s=1, name="test-missing")
    if dist.get_rank() == 2:
        return "away"
    try:
        stop.should_stop()
    except DDTrainError as exc:
        return str(exc)
    return "answered"


def test_a_check_that_not_every_rank_reaches_fails_at_its_deadline_naming_the_count():
    results = run_ranks(_one_rank_missing, 3)
    assert results[2] == "away"
    for text in results[:2]:
        assert "only 2 of the 3 ranks arrived within the 1 s deadline" in text, text


def test_the_preemption_settings_are_checked_naming_the_flag():
    from ddtrain.errors import ConfigError
    from ddtrain.reliability.config import ReliabilityConfig
    for settings, message in [({"preempt_signal": "KILL", "checkpoint_dir": "d"},
                               "preempt_signal 'KILL': SIGKILL cannot be caught, so no checkpoint could follow it"),
                              ({"preempt_signal": "USR1"}, "preempt_signal needs checkpoint_dir"),
                              ({"requeue": True}, "requeue needs checkpoint_dir"),
                              ({"preempt_grace_s": 0, "checkpoint_dir": "d"},
                               "preempt_grace_s must be a positive number of seconds, got 0")]:
        with pytest.raises(ConfigError) as caught:
            ReliabilityConfig(**settings)
        assert str(caught.value) == message
    assert ReliabilityConfig(checkpoint_dir="d", preempt_signal="usr1,USR2").preempt_signals() == \
        ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
