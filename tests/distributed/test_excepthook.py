"""One traceback per distinct error across ranks (ddtrain.distributed.excepthook), in process and under torchrun."""
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from ddtrain.distributed import excepthook
from helpers import REPO
from multirank import free_port


def raise_here(exc):
    raise exc


def report(store, rank, exc, capsys, monkeypatch, through=raise_here):
    """Run the hook of a process of rank ``rank`` on ``exc`` raised by ``through`` (``raise_here``); its stderr."""
    monkeypatch.setattr(excepthook, "_installed", False)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    excepthook.install(rank, lambda: store)
    try:
        through(exc)
    except BaseException as caught:
        sys.excepthook(type(caught), caught, caught.__traceback__)
    return capsys.readouterr().err


def test_the_first_rank_prints_the_traceback_and_the_others_one_line_each(capsys, monkeypatch):
    store = dist.HashStore()
    first = report(store, 2, ValueError("bad on rank 2"), capsys, monkeypatch)
    second = report(store, 0, ValueError("bad on rank 0"), capsys, monkeypatch)
    assert first.count("Traceback (most recent call last)") == 1 and "ValueError: bad on rank 2" in first
    assert "Traceback" not in second
    assert second.strip() == ("[rank 0] ValueError: bad on rank 0 (the same error at the same place as rank 2, "
                              "whose traceback is printed)")


def test_a_different_error_is_printed_in_full(capsys, monkeypatch):
    store = dist.HashStore()
    report(store, 0, ValueError("x"), capsys, monkeypatch)
    other = report(store, 1, KeyError("y"), capsys, monkeypatch)
    assert "Traceback (most recent call last)" in other and "KeyError: 'y'" in other


def through_loading(exc):
    raise_here(exc)


def through_training(exc):
    raise_here(exc)


def test_the_same_line_reached_through_another_call_chain_is_another_error(capsys, monkeypatch):
    """The key is every frame, not the innermost one: a helper that fails when called from loading and from training
    fails at two places, and each gets its traceback printed; the same chain with another message is the same error."""
    def key(call, message):
        try:
            call(ValueError(message))
        except ValueError as caught:
            return excepthook.error_key(ValueError, caught.__traceback__)
    assert key(through_loading, "a") == key(through_loading, "b")
    assert key(through_loading, "a") != key(through_training, "a")
    store = dist.HashStore()
    report(store, 0, ValueError("x"), capsys, monkeypatch, through=through_loading)
    other = report(store, 1, ValueError("x"), capsys, monkeypatch, through=through_training)
    assert "Traceback (most recent call last)" in other and "through_training" in other


def test_without_a_store_every_rank_prints_its_traceback(capsys, monkeypatch):
    def gone():
        raise RuntimeError("connection refused")
    monkeypatch.setattr(excepthook, "_installed", False)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    excepthook.install(1, gone)
    try:
        raise_here(ValueError("z"))
    except ValueError as caught:
        sys.excepthook(ValueError, caught, caught.__traceback__)
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ValueError: z" in err


SCRIPT = textwrap.dedent("""
    import ddtrain
    ddtrain.init()
    if ddtrain.rank() == 2:
        raise KeyError("only rank 2")
    raise ValueError(f"bad value on rank {ddtrain.rank()}")
""")


@pytest.mark.slow
def test_under_torchrun_three_ranks_print_two_tracebacks_and_one_line(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
                           str(free_port()), str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode != 0
    workers = "\n".join(line for line in proc.stderr.splitlines() if "[rank" in line)
    # torchrun's own traceback (its ChildFailedError) is not a worker's: count the workers' lines only
    assert workers.count("Traceback (most recent call last)") == 2, workers
    assert workers.count("KeyError: 'only rank 2'") == 1, workers
    assert workers.count("(the same error at the same place as rank") == 1, workers
