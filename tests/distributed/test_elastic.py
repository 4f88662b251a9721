"""Elastic membership, without processes: MIN:MAX parsing and its bad input, the sizes a run may
shrink to, the launcher's decisions after a loss (run_local replaced by a script of outcomes),
the rendezvous settings and the membership list carried in the checkpoint directory.

The launches themselves (3 -> 2 local workers, 3 -> 2 emulated nodes) are in
tests/distributed/test_elastic_local.py and tests/integration/test_elastic_cluster.py (slow tier).
"""
from __future__ import annotations

import os
import signal

import pytest

from ddtrain.config import TrainConfig
from ddtrain.distributed import job, launch, rendezvous
from ddtrain.distributed.config import DistConfig, size_range
from ddtrain.distributed.plan import LaunchSpec, plan_launch
from ddtrain.errors import ConfigError, DDTrainError
from ddtrain.reliability import ownership
from helpers import assert_one_clear_error, ddtrain


@pytest.mark.parametrize("text, expected", [("3", (3, 3)), (3, (3, 3)), ("2:4", (2, 4)), (" 1:1 ", (1, 1))])
def test_size_range_reads_n_and_min_max(text, expected):
    assert size_range(text, "nproc") == expected


@pytest.mark.parametrize("text, words", [
    ("4:2", "MIN 4 is more than MAX 2"), ("0:2", "MIN must be at least 1"), ("0", "must be at least 1, got '0'"),
    ("2.5", "whole number"), ("2:x", "whole number"), ("", "whole number"), (":3", "whole number"),
    ("-1:3", "whole number"), (True, "whole number")])
def test_size_range_refuses_bad_ranges_naming_the_flag(text, words):
    with pytest.raises(ConfigError) as info:
        size_range(text, "nproc")
    assert words in str(info.value) and info.value.flag == "--nproc"


def test_dist_config_nnodes_range_bounds_the_node_rank():
    config = DistConfig(nnodes="2:3", node_rank=2, rdzv_endpoint="10.0.0.1:29400")
    assert (config.min_nodes, config.max_nodes) == (2, 3)
    with pytest.raises(ConfigError, match="node_rank"):
        DistConfig(nnodes="2:3", node_rank=3, rdzv_endpoint="10.0.0.1:29400")
    with pytest.raises(ConfigError, match="MIN 3 is more than MAX 2"):
        DistConfig(nnodes="3:2", rdzv_endpoint="10.0.0.1:29400")


def test_elastic_sizes_skip_sizes_that_cannot_share_the_global_batch():
    from ddtrain.cli.train import launch_spec, shares_global_batch

    def elastic_sizes(config, least, most):  # ddtrain train's rule: its recipe (which may re-choose --grad-accum)
        return launch_spec(config, least, most, 0).elastic_sizes(least, most, shares_global_batch(config))
    config = TrainConfig.from_flat(model="mlp", data="digits", global_batch_size=48)
    assert elastic_sizes(config, 2, 4) == [4, 3, 2]
    assert elastic_sizes(TrainConfig.from_flat(model="mlp", data="digits", global_batch_size=40), 3, 4) == [4]
    with pytest.raises(DDTrainError, match="cannot start on 5; world sizes that can share it: 1, 2, 3, 4, 6, 8"):
        elastic_sizes(config, 2, 5)
    with pytest.raises(DDTrainError, match="runs on none of them; world sizes that can share it: 1, 2, 5, 10"):
        elastic_sizes(TrainConfig.from_flat(model="mlp", data="digits", global_batch_size=50), 3, 4)
    with pytest.raises(DDTrainError, match="needs --global-batch-size"):
        elastic_sizes(TrainConfig.from_flat(model="mlp", data="digits"), 2, 3)


def test_the_library_default_rule_is_that_the_global_batch_divides_by_the_workers():
    # ddtrain run's rule (no recipe): a size is offered when it divides G; 7 and 5 do not divide 42 (nor 7 of 12)
    assert LaunchSpec(nproc=7, min_nproc=2, global_batch_size=42).elastic_sizes(2, 7) == [7, 6, 3, 2]
    with pytest.raises(DDTrainError) as info:
        LaunchSpec(nproc=5, min_nproc=4, global_batch_size=42).elastic_sizes(4, 5)
    assert str(info.value) == ("--nproc 4:5: --global-batch-size 42 runs on none of them; world sizes that can "
                               "share it: 1, 2, 3, 6, 7, 14")
    with pytest.raises(DDTrainError, match=r"--nproc 2:3: --strategy ps-sync has 2 server rank\(s\), so MIN must be"):
        LaunchSpec(nproc=3, min_nproc=2, global_batch_size=12, strategy="ps-sync", server_ranks=2).elastic_sizes(2, 3)


def _plan(**fields):
    return plan_launch(LaunchSpec(**fields))


def test_plan_decides_local_elastic_and_multi_node_launches(tmp_path, monkeypatch):
    monkeypatch.delenv("DDTRAIN_RUN_ID", raising=False)
    fixed = _plan(nproc=3, max_restarts=2)
    assert (fixed.sizes, fixed.nodes, fixed.max_restarts, fixed.workers) == ((3,), None, 2, 3)
    elastic = _plan(nproc=4, min_nproc=2, checkpoint_dir=str(tmp_path), global_batch_size=12, server_ranks=1)
    assert elastic.sizes == (4, 3, 2) and elastic.limits == (2, 4) and elastic.workers == 3  # 3, 2 and 1 workers
    nodes = _plan(nproc=2, dist=DistConfig(nnodes="2:3", node_rank=1, rdzv_endpoint="127.0.0.1:29400"),
                  max_restarts=1, checkpoint_dir=str(tmp_path), global_batch_size=12)
    assert nodes.sizes == (2,) and nodes.nodes == ("2:3", 1, "127.0.0.1:29400") and not nodes.joining
    assert os.environ["DDTRAIN_RUN_ID"] == "nodes-127.0.0.1:29400"   # every node's launcher: one run
    monkeypatch.delenv("DDTRAIN_RUN_ID")
    joins = plan_launch(LaunchSpec(nproc=2, dist=DistConfig(nnodes="2:3", rdzv_endpoint="127.0.0.1:29400"),
                                   max_restarts=1, checkpoint_dir=str(tmp_path), global_batch_size=12),
                        joining=lambda directory: directory == str(tmp_path))
    assert joins.joining
    resuming = plan_launch(LaunchSpec(nproc=2, dist=DistConfig(nnodes="2:3", rdzv_endpoint="127.0.0.1:29400"),
                                      max_restarts=1, checkpoint_dir=str(tmp_path), global_batch_size=12,
                                      resume=True), joining=lambda directory: True)
    assert not resuming.joining   # its workers resume anyway


@pytest.mark.parametrize("fields, words", [
    ({"nproc": 3, "min_nproc": 2, "dist": DistConfig(nnodes=2, rdzv_endpoint="127.0.0.1:29400"),
      "checkpoint_dir": "ck", "global_batch_size": 12}, "--nproc 2:3 is for one machine"),
    ({"nproc": 2, "global_batch_size": 7}, "--global-batch-size 7 cannot be shared by 2 worker(s); worker counts "
                                          "that can: 1, 7"),
    ({"nproc": 2, "dist": DistConfig(nnodes=2, rdzv_endpoint="127.0.0.1:29400"), "global_batch_size": 6},
     "--global-batch-size 6 cannot be shared by 4 worker(s)"),
    ({"nproc": 2, "server_ranks": 2, "strategy": "ps-sync"}, "--strategy ps-sync with --servers 2 needs --nproc of "
                                                             "at least 3 (one worker)"),
])
def test_plan_refuses_what_cannot_run(fields, words):
    with pytest.raises(DDTrainError) as info:
        _plan(**fields)
    assert words in str(info.value)


def test_min_above_max_gives_one_message_and_creates_nothing(tmp_path):
    result = ddtrain("train", "--model", "mlp", "--data", "digits", "--nproc", "3:2", "--global-batch-size", "48",
                     "--checkpoint-dir", str(tmp_path / "ck"), timeout=120)
    assert_one_clear_error(result, "--nproc MIN 3 is more than MAX 2 in '3:2'")
    assert not (tmp_path / "ck").exists()


def _train(argv):
    """ddtrain train's own main, in this process (the refusals come before any worker or file)."""
    import argparse
    from ddtrain.cli import train
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    return train.main(args)


@pytest.mark.parametrize("flags, words", [
    (["--nproc", "2:3"], "--nproc 2:3 needs --checkpoint-dir"),
    (["--nproc", "2:3", "--checkpoint-dir", "{tmp}/ck"], "--nproc 2:3 needs --global-batch-size"),
    (["--nproc", "3:4", "--checkpoint-dir", "{tmp}/ck", "--global-batch-size", "50"],
     "runs on none of them; world sizes that can share it: 1, 2, 5, 10"),
    (["--nnodes", "2:3", "--rdzv-endpoint", "127.0.0.1:29400", "--checkpoint-dir", "{tmp}/ck"],
     "--nnodes 2:3 needs --max-restarts of at least 1"),
    (["--nnodes", "2:3", "--rdzv-endpoint", "127.0.0.1:29400", "--max-restarts", "1"], "--nnodes 2:3 needs --checkpoint-dir"),
    (["--nnodes", "2:3", "--nproc", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--max-restarts", "1",
      "--checkpoint-dir", "{tmp}/ck", "--global-batch-size", "40"], "--nnodes 2:3 with --nproc 2: --global-batch-size 40"),
])
def test_bad_elastic_flags_are_refused_before_anything_starts(flags, words, tmp_path, monkeypatch):
    monkeypatch.delenv("DDTRAIN_RUN_ID", raising=False)
    with pytest.raises(DDTrainError) as info:
        _train(["--model", "mlp", "--data", "digits", "--steps", "2", *[f.format(tmp=tmp_path) for f in flags]])
    assert words in str(info.value)
    assert not (tmp_path / "ck").exists()


class _Script:
    """Stands for run_local: each call takes the next outcome ((exit code, lost ranks) or 0) and records its size."""

    def __init__(self, outcomes):
        self.outcomes, self.calls = list(outcomes), []

    def __call__(self, nproc, argv, *, env=None, module="ddtrain", outcome=None, **_):
        self.calls.append((nproc, env[rendezvous.ATTEMPT_BASE_ENV], env[launch.MEMBERSHIP_REASON_ENV]))
        result = self.outcomes.pop(0)
        if result == 0:
            return 0
        code, lost = result
        outcome.update(rank=lost[0] if lost else 0, exitcode=code, lost=lost, line=f"ddtrain: error: failed {code}",
                       what=f"worker rank {lost[0] if lost else 0} " + ("was killed by SIGKILL" if lost else "failed"))
        return 1


def test_run_elastic_goes_on_with_fewer_workers_and_stops_below_min(monkeypatch, capsys):
    killed = (-signal.SIGKILL, [2])
    script = _Script([killed, (-signal.SIGKILL, [1, 3]), 0])
    monkeypatch.setattr(launch, "run_local", script)
    assert launch.run_elastic([6, 5, 4, 3, 2], ["train"], limits=(2, 6)) == 0
    # 6 -> 5 (one lost) -> 3 (two lost); each attempt resumes (its base is the attempts before it)
    assert [(n, base) for n, base, _ in script.calls] == [(6, "0"), (5, "1"), (3, "2")]
    assert script.calls[1][2] == "worker rank 2 was killed by SIGKILL: world size 6 -> 5"
    assert "going on with 5 workers (--nproc 2:6) from the last checkpoint" in capsys.readouterr().err

    script = _Script([(-signal.SIGKILL, [0, 1])])
    monkeypatch.setattr(launch, "run_local", script)
    assert launch.run_elastic([3, 2], ["train"], limits=(2, 3)) != 0
    err = capsys.readouterr().err
    assert "1 worker(s) left, fewer than the 2 that --nproc 2:3 needs at least" in err and err.count("error") == 1


def test_run_elastic_skips_sizes_that_cannot_run_and_restarts_errors_at_the_same_size(monkeypatch, capsys):
    script = _Script([(-signal.SIGKILL, [0]), (1, []), 0])
    monkeypatch.setattr(launch, "run_local", script)
    assert launch.run_elastic([4, 2], ["train"], max_restarts=1, limits=(2, 4)) == 0
    assert [n for n, _, _ in script.calls] == [4, 2, 2]  # 3 cannot share the batch: 4 -> 2; an error: same size
    assert "restarting all workers (restart 1 of 1)" in capsys.readouterr().err

    script = _Script([(1, [])])
    monkeypatch.setattr(launch, "run_local", script)
    assert launch.run_elastic([4, 2], ["train"], limits=(2, 4)) != 0   # no restarts left: the job's own error
    assert capsys.readouterr().err.strip() == "ddtrain: error: failed 1"


def test_lost_means_killed_by_a_signal_other_than_a_stop():
    assert launch._lost(-signal.SIGKILL) and launch._lost(-signal.SIGSEGV)
    assert not launch._lost(-signal.SIGTERM) and not launch._lost(1) and not launch._lost(launch.LOST_PEER_EXIT)


def test_elastic_conf_adds_heartbeat_and_last_call_keeping_given_values():
    out = launch.elastic_conf(["--rdzv-backend", "c10d", "--rdzv-conf", "is_host=true,last_call_timeout=9"])
    conf = dict(item.split("=") for item in out[out.index("--rdzv-conf") + 1].split(","))
    assert conf == {"last_call_timeout": "9", "keep_alive_interval": "1", "keep_alive_max_attempt": "3",
                    "is_host": "true"}
    assert out.count("--rdzv-conf") == 1


def test_attempt_base_counts_earlier_torchruns_once(monkeypatch):
    monkeypatch.setenv(job.RESTART_COUNT_ENV, "1")
    monkeypatch.setenv(rendezvous.ATTEMPT_BASE_ENV, "2")
    rendezvous.add_attempt_base()
    rendezvous.add_attempt_base()
    assert os.environ[job.RESTART_COUNT_ENV] == "3" and rendezvous.ATTEMPT_BASE_ENV not in os.environ


def test_membership_list_is_carried_across_attempts_and_reset_by_a_fresh_run(tmp_path, monkeypatch):
    monkeypatch.delenv(launch.MEMBERSHIP_REASON_ENV, raising=False)
    note = ownership.note_membership
    assert [e["reason"] for e in note(tmp_path, step=0, world_size=3, attempt=0, resumed=False, write=True)] == ["start"]
    entries = note(tmp_path, step=4, world_size=2, attempt=1, resumed=True, write=True)
    assert [(e["step"], e["world_size"], e["attempt"]) for e in entries] == [(0, 3, 0), (4, 2, 1)]
    assert entries[1]["reason"] == "restart 1: 1 rank(s) gone, world size 3 -> 2" and entries[1]["at"].endswith("Z")
    monkeypatch.setenv(launch.MEMBERSHIP_REASON_ENV, "worker rank 1 was killed by SIGKILL: world size 2 -> 1")
    entries = note(tmp_path, step=8, world_size=1, attempt=2, resumed=True, write=True)
    assert entries[-1]["reason"] == "worker rank 1 was killed by SIGKILL: world size 2 -> 1"
    monkeypatch.delenv(launch.MEMBERSHIP_REASON_ENV)
    assert note(tmp_path, step=8, world_size=4, attempt=0, resumed=True, write=False)[-1]["reason"] == \
        "--resume at world size 4 (was 1)"
    assert len(ownership.membership(tmp_path)) == 3          # write=False (not rank 0) wrote nothing
    assert len(note(tmp_path, step=0, world_size=2, attempt=0, resumed=False, write=True)) == 1
    assert len(ownership.membership(tmp_path)) == 1


def test_agents_count_every_restart_of_their_workers(monkeypatch):
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    seen = []
    monkeypatch.setattr(SimpleElasticAgent, "_restart_workers", lambda self, group: seen.append(group))
    monkeypatch.delenv(rendezvous.REFORMS_ENV, raising=False)
    launch.count_reforms()
    launch.count_reforms()   # wraps once
    SimpleElasticAgent._restart_workers(None, "group")   # a failure, or a node joining: torchrun calls the same
    SimpleElasticAgent._restart_workers(None, "group")
    assert seen == ["group", "group"] and os.environ[rendezvous.REFORMS_ENV] == "2"
    # the workers started after the second one: attempt 2, although torchrun's count says 0 (no failure)
    monkeypatch.setenv(job.RESTART_COUNT_ENV, "0")
    rendezvous.add_attempt_base()
    assert os.environ[job.RESTART_COUNT_ENV] == "2"


def test_a_directory_held_by_another_process_of_this_run_is_recognised(tmp_path, monkeypatch):
    import multiprocessing
    context = multiprocessing.get_context("fork")
    ready, stop = context.Event(), context.Event()

    def hold():  # another node's launcher of the same run
        os.environ[ownership.RUN_ID_ENV] = "run-a"
        ownership.claim(tmp_path, "launcher")
        ready.set()
        stop.wait(30)
    child = context.Process(target=hold)
    child.start()
    try:
        assert ready.wait(30)
        monkeypatch.setenv(ownership.RUN_ID_ENV, "run-a")
        assert ownership.held_by_this_run(tmp_path)
        monkeypatch.setenv(ownership.RUN_ID_ENV, "run-b")
        assert not ownership.held_by_this_run(tmp_path)
    finally:
        stop.set()
        child.join(10)
    monkeypatch.setenv(ownership.RUN_ID_ENV, "run-a")
    assert not ownership.held_by_this_run(tmp_path)   # its process ended: nobody holds it
