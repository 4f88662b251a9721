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


def _ranks_stop_together(signalled_rank: int, at_check: int, checks: int):
    """Every rank checks ``checks`` times; ``signalled_rank`` signals itself (a real SIGTERM) before check ``at_check``."""
    import torch.distributed as dist
    from ddtrain.distributed.job import default_store
    answers = []
    with Preemption(participants=dist.get_world_size(), timeout_s=30, name="test-together") as stop:
        for check in range(1, checks + 1):
            if check == at_check and dist.get_rank() == signalled_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            answers.append(stop.should_stop())
        prefix = stop._prefix
    store = default_store()
    left = [check for check in range(1, checks + 1) if store.check([f"{prefix}/{check}"])]
    return answers, stop.requested, left


def test_three_ranks_stop_at_the_same_check_when_only_rank_1_is_signalled():
    results = run_ranks(_ranks_stop_together, 3, 1, 4, 6)
    for rank, (answers, requested, _) in enumerate(results):
        assert answers == [False, False, False, True, True, True], (rank, answers)
        assert requested == (rank == 1)
    # the last to arrive at a check removes the previous check's keys: only the fourth's are left (no later check ran)
    assert all(left == [4] for _, _, left in results), results


def _no_signal(checks: int):
    import torch.distributed as dist
    with Preemption(participants=dist.get_world_size(), timeout_s=30, name="test-none") as stop:
        return [stop.should_stop() for _ in range(checks)]


def test_no_signal_no_stop_on_three_ranks():
    assert run_ranks(_no_signal, 3, 5) == [[False] * 5] * 3


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
