"""Deliberate bugs against the test suite: each mutation applied to a copy, its targeted tests run, caught or not.

    python tools/mutation_check.py                       # all mutations, a copy of HEAD
    python tools/mutation_check.py --only hybrid-never-broadcasts resume-retrains-from-step-0
    python tools/mutation_check.py --source worktree     # a copy of the working tree instead
    python tools/mutation_check.py --list                # what each mutation changes, and its tests
    python tools/mutation_check.py --only ps-state-headers-first --repeat 10   # caught on every one of 10 runs?
    python tools/mutation_check.py --only elastic-metrics-rank0-only -m slow --tests TEST   # another (slow) test

Issue 21's audit: 19 mutations, of which 13 were caught and 6 survived (the tests passed with
the bug in). Issue 31: 22 more (``ISSUE_31``), one per behaviour its audit found unguarded (bugs
put into recent code that the suite did not see) and one for the resume-schedule refusal it
asked for, each naming the test written for it. These hand-written patches are the fast
regression set. The broad, generated campaign over whole packages is
``tools/mutation_run.py`` (cosmic-ray; docs/TESTING.md).

Each mutation here is a small textual patch (file, old snippet, new snippet) and the
tests that must fail on it. The script copies the repository once (``git archive HEAD`` of
src/ and tests/, or the working tree), runs the union of the selected tests on the unmutated
copy first (the baseline: they must pass, or a "catch" would mean nothing), then for each
mutation patches one file, runs only that mutation's tests (``pytest -x``), and restores the
file. A mutation counts as caught when pytest reports failed tests (exit code 1); a patch that
no longer applies, or an error of another kind (collection, timeout), is reported as such,
never as a catch. Prints a fixed-width table and writes ``results/mutations/table.json``.
The real repository is never modified.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "results" / "mutations" / "table.json"


@dataclass
class Mutation:
    name: str
    what: str                     # the bug, in words
    file: str                     # relative to the repository root
    old: str                      # must occur exactly once in the file
    new: str
    tests: list[str] = field(default_factory=list)   # pytest node ids; empty: no test yet (pending)
    audit: str = "caught"         # what issue 21's audit saw: "caught" or "survived"


SYNC_EQ = ("tests/sync/test_sync_equivalence.py::"
           "test_every_synchronous_strategy_takes_the_steps_of_a_plain_loop_with_the_global_batch")
ALLREDUCE = "tests/comm/test_comm_allreduce.py::test_every_algorithm_matches_torch_and_is_bitwise_identical_across_ranks"
RESUME = "tests/reliability/test_checkpoint.py::test_resume_mid_epoch_is_step_for_step_identical"
STALL = "tests/reliability/test_stall_ranks.py::test_the_skipping_and_the_frozen_rank_are_named_and_their_waiting_peers_are_not"

MUTATIONS = [
    # ---- the 13 the audit's suite already caught -------------------------------------------
    Mutation("ring-drops-first-contribution", "ring reduce-scatter ignores the chunk received in its first step",
             "src/ddtrain/comm/ring.py", "        combine(flat[lo:hi], incoming)\n",
             "        combine(flat[lo:hi], incoming) if s else None\n", [ALLREDUCE]),
    Mutation("ring-skips-last-all-gather-step", "ring all-gather stops one step early (a chunk never arrives)",
             "src/ddtrain/comm/ring.py",
             "    for s in range(n - 1):\n        send_c, recv_c = (r + first - s) % n, (r + first - s - 1) % n\n",
             "    for s in range(max(n - 2, 1)):\n        send_c, recv_c = (r + first - s) % n, (r + first - s - 1) % n\n",
             [ALLREDUCE]),
    Mutation("butterfly-drops-halving-contribution", "butterfly's first recursive-halving step keeps its half unreduced",
             "src/ddtrain/comm/butterfly.py", "        combine(flat[keep[0]:keep[1]], incoming)\n",
             "        combine(flat[keep[0]:keep[1]], incoming) if step else None\n", [ALLREDUCE]),
    Mutation("butterfly-drops-folded-rank", "butterfly on a non-power-of-two world forgets the folded-in rank's data",
             "src/ddtrain/comm/butterfly.py", "        combine(flat, incoming)\n        del incoming\n",
             "        del incoming\n", [ALLREDUCE]),
    Mutation("tree-drops-first-level-child", "tree reduce ignores the child of its first level",
             "src/ddtrain/comm/tree.py", "            combine(tensors, incoming)\n",
             "            combine(tensors, incoming) if level else None\n", [ALLREDUCE]),
    Mutation("ddp-hook-zeroes-rank-1", "the DDP communication hook zeroes rank 1's gradient before averaging",
             "src/ddtrain/sync/allreduce.py",
             'comm.all_reduce(buffer, self.algorithm, op="avg", group=self.group)',
             'comm.all_reduce(buffer.zero_() if torch.distributed.get_rank() == 1 else buffer, self.algorithm, '
             'op="avg", group=self.group)', [SYNC_EQ + "[2]"]),
    Mutation("ps-sync-drops-a-worker", "the synchronous parameter server leaves the second worker out of the sum",
             "src/ddtrain/sync/ps/serve_sync.py", "        for w in active[1:]:",
             "        for w in active[2:]:", [SYNC_EQ + "[3]"]),
    Mutation("optimizer-state-not-restored", "resume loads the model but not the optimizer (momentum lost)",
             "src/ddtrain/reliability/checkpoint.py", 'self.optimizer.load_state_dict(state["optimizer"])',
             "pass  # the optimizer's state is not restored", [RESUME]),
    Mutation("rng-not-restored", "resume does not restore the RNG state after the skipped batches (dropout differs)",
             "src/ddtrain/reliability/checkpoint.py",
             '        set_rng_state(part["rng"])\n        return it\n', "        return it\n", [RESUME]),
    Mutation("table-5.1-centralized", "000 Table 5.1: the centralized count uses R instead of R-1",
             "src/ddtrain/costmodel/counts.py", "Fraction(2 * steps_per_epoch * params * (workers - 1))",
             "Fraction(2 * steps_per_epoch * params * workers)", ["tests/costmodel/test_costmodel.py"]),
    Mutation("table-5.1-decentralized", "000 Table 5.1: the ring count loses its factor 2",
             "src/ddtrain/costmodel/counts.py", "Fraction(2 * steps_per_epoch * params * (workers - 1), workers)",
             "Fraction(steps_per_epoch * params * (workers - 1), workers)", ["tests/costmodel/test_costmodel.py"]),
    Mutation("table-5.1-proposed", "000 Table 5.1: the broadcast term forgets the R-1 receivers",
             "src/ddtrain/costmodel/counts.py", "+ broadcasts_per_epoch * params * (workers - 1))",
             "+ broadcasts_per_epoch * params)", ["tests/costmodel/test_costmodel.py"]),
    Mutation("traffic-under-counted", "the traffic counters record half the bytes sent",
             "src/ddtrain/comm/traffic.py",
             "counts.add(Counts(bytes_sent, bytes_received, messages_sent, messages_received, method))",
             "counts.add(Counts(bytes_sent // 2, bytes_received, messages_sent, messages_received, method))",
             ["tests/comm/test_comm_traffic.py::test_counted_bytes_equal_each_algorithms_formula"]),
    # ---- the 6 that survived the audit, and the test written for each (issue 21) --------------
    Mutation("stall-names-every-peer", "the stall report names every peer it heard from, not only those elsewhere",
             "src/ddtrain/reliability/stall.py", '        elif (m["step"], m["op"]) != (step, op):\n',
             "        else:\n",
             [STALL], audit="survived"),
    Mutation("resume-retrains-from-step-0", "resume reports the checkpoint but silently trains from step 0",
             "src/ddtrain/reliability/checkpoint.py", "        header, shared, part = got\n",
             "        header, shared, part = got\n"
             '        self.info["resumed_from"] = {"path": header["path"], "step": header["step"], '
             '"epoch": header["epoch"], "step_in_epoch": header["step_in_epoch"]}\n'
             "        return\n",
             ["tests/reliability/test_resume_not_retrained.py"], audit="survived"),
    Mutation("hybrid-never-broadcasts", "hybrid broadcasts (and counts) a copy of rank 0's state, never its replicas",
             "src/ddtrain/sync/hybrid.py",
             "broadcast_(state_tensors(self.module, buffers=not self.ddp_broadcasts_buffers), counted=True)",
             "broadcast_([t.clone() for t in state_tensors(self.module, buffers=not self.ddp_broadcasts_buffers)],"
             " counted=True)",
             ["tests/sync/test_hybrid_broadcasts.py"], audit="survived"),
    Mutation("ps-async-ignores-a-worker", "the asynchronous parameter server applies worker 1's gradients as 0",
             "src/ddtrain/sync/ps/serve_async.py", "core.apply_(grads, core.inbox[w]",
             "core.apply_(grads * (w != 1), core.inbox[w]", ["tests/sync/test_ps_async_order.py"],
             audit="survived"),
    Mutation("every-gradient-halved", "the loop backpropagates half the loss: every gradient halved, on every path",
             "src/ddtrain/training/loop.py", "(scaler.scale(weighted) if scaler else weighted).backward()",
             "(scaler.scale(weighted) if scaler else weighted * 0.5).backward()",
             ["tests/training/test_train_equivalence.py::test_one_process_equals_the_plain_loop", SYNC_EQ + "[2]"],
             audit="survived"),
    Mutation("resnet-residual-times-0", "the ResNet block's residual branch is multiplied by 0",
             "src/ddtrain/models/resnet.py", "return torch.relu(self.body(x) + self.shortcut(x))",
             "return torch.relu(self.body(x) * 0 + self.shortcut(x))",
             ["tests/models/test_models_function.py"], audit="survived"),
]

# ---- issue 31: the behaviours its audit found unguarded, one plausible bug each, and the test written for it
# (results/mutations/behaviours.md records each test failing with the bug and passing without)
COMPRESSION = "tests/comm/test_compression_methods.py::"
DILOCO = "tests/sync/test_diloco.py::"
ELASTIC = "tests/reliability/test_elastic_resume.py::"
CHECKPOINT = "tests/reliability/test_checkpoint.py::"
ISSUE_31 = [
    Mutation("powersgd-orthogonalises-3-columns", "PowerSGD's Gram-Schmidt projects each column out of the next two "
             "only: exact up to rank 3, not orthogonal from rank 4", "src/ddtrain/comm/compression/powersgd.py",
             "            rest = matrices[:, :, i + 1:]\n", "            rest = matrices[:, :, i + 1:i + 3]\n",
             [COMPRESSION + "test_powersgd_matches_the_published_algorithm_on_three_ranks_and_sends_its_formula"]),
    Mutation("powersgd-warmup-counts-buffers", "PowerSGD's warm-up counts buffers (DDP buckets) instead of steps",
             "src/ddtrain/comm/compression/powersgd.py",
             "            self.steps += last\n            return flat\n",
             "            self.steps += 1\n            return flat\n",
             [COMPRESSION + "test_powersgd_warmup_counts_steps_not_buffers"]),
    Mutation("cast-sums-before-dividing", "fp16/bf16 sum the 16-bit gradients before dividing by R (inf at 3 x 40,000)",
             "src/ddtrain/comm/compression/cast.py",
             "        compressed = flat.to(self.dtype).div_(group_size(group))\n"
             "        comm.all_reduce(compressed, algorithm, op=\"sum\", group=group, timeout_s=timeout_s)\n"
             "        return flat.copy_(compressed)\n",
             "        compressed = flat.to(self.dtype)\n"
             "        comm.all_reduce(compressed, algorithm, op=\"sum\", group=group, timeout_s=timeout_s)\n"
             "        return flat.copy_(compressed.div_(group_size(group)))\n",
             [COMPRESSION + "test_16_bit_casts_divide_by_r_before_the_sum_so_large_gradients_stay_finite_on_three_ranks"]),
    Mutation("diloco-spread-sign", "DiLoCo measures the spread around anchor + mean outer gradient (a sign slip)",
             "src/ddtrain/sync/local_sgd.py", "            mean = [a - g for a, g in zip(self.anchor, outer_grads)]",
             "            mean = [a + g for a, g in zip(self.anchor, outer_grads)]",
             [DILOCO + "test_each_averaging_logs_the_replicas_spread_around_their_mean"]),
    Mutation("adaptive-budget-rounded", "--adaptive-interval rounds the communication budget's interval to nearest "
             "instead of up", "src/ddtrain/sync/local_sgd.py",
             "    by_comm = math.ceil(averaging_s / (comm_fraction * step_s))",
             "    by_comm = round(averaging_s / (comm_fraction * step_s))",
             [DILOCO + "test_choose_interval_rounds_the_budget_up_and_the_divergence_bound_down"]),
    Mutation("adaptive-bound-rounded-up", "--adaptive-interval rounds the divergence bound's interval up (past the bound)",
             "src/ddtrain/sync/local_sgd.py", "    by_divergence = math.floor(interval * max_divergence / divergence)",
             "    by_divergence = math.ceil(interval * max_divergence / divergence)",
             [DILOCO + "test_choose_interval_rounds_the_budget_up_and_the_divergence_bound_down"]),
    Mutation("local-sgd-warmup-end-resume", "a local-sgd checkpoint written at the warm-up's last step resumes inside "
             "the warm-up (gradients averaged every step for ever)", "src/ddtrain/sync/local_sgd.py",
             "        if self.warmup_steps and self.steps >= self.warmup_steps:\n",
             "        if self.warmup_steps and self.steps > self.warmup_steps:\n",
             ["tests/reliability/test_strategy_state_resume.py::test_a_resumed_run_keeps_the_strategys_schedule_and_"
              "outer_state[local-sgd-checkpoint-at-warmup-end]"]),
    Mutation("elastic-new-ranks-share-a-stream", "an elastic resume seeds every new rank from the same (seed, step)",
             "src/ddtrain/reliability/checkpoint_elastic.py", "            rng = derived_rng(seed, step, r, capture, apply)",
             "            rng = derived_rng(seed, step, was, capture, apply)",
             [ELASTIC + "test_reshape_adds_every_workers_metric_sums_on_rank_0_and_seeds_each_new_rank_from_its_own_rank"]),
    Mutation("elastic-metrics-rank0-only", "an elastic resume keeps rank 0's epoch sums only (the others' samples lost)",
             "src/ddtrain/reliability/checkpoint_elastic.py", '    meter = sum(p["meter"] for p in worker_parts)',
             '    meter = worker_parts[0]["meter"]',
             [ELASTIC + "test_reshape_adds_every_workers_metric_sums_on_rank_0_and_seeds_each_new_rank_from_its_own_rank"]),
    Mutation("grad-accum-largest", "a resize re-chooses the largest accumulation that fits, not the smallest",
             "src/ddtrain/recipe/__init__.py", "    return larger[0] if larger else fits[-1]",
             "    return larger[-1] if larger else fits[-1]",
             ["tests/recipe/test_recipe.py::test_a_resize_keeps_the_global_batch_with_the_smallest_accumulation_that_fits"]),
    Mutation("short-micro-batch-full-weight", "a short last micro-batch is weighted as a full one (1/K each)",
             "src/ddtrain/training/loop.py",
             "            share = loss * (weigh(y.shape[0]) if weigh is not None else y.shape[0] / total)",
             "            share = loss / len(group)",
             ["tests/training/test_recipe_accumulation.py::test_a_short_last_micro_batch_weighs_by_its_samples_not_as_a_"
              "full_one"]),
    Mutation("resume-restarts-lr-schedule", "a resumed run restarts the lr schedule at update 0",
             "src/ddtrain/training/loop.py", "            schedule.jump_to(state.step)",
             "            schedule.jump_to(0)",
             [CHECKPOINT + "test_a_run_resumed_mid_schedule_takes_the_uninterrupted_runs_learning_rates"]),
    Mutation("scale-lr-counts-servers", "--scale-lr counts the parameter servers as workers",
             "src/ddtrain/training/loop.py", "    optimizer = optimizer or recipe.build_optimizer(config.recipe, model, workers)",
             "    optimizer = optimizer or recipe.build_optimizer(config.recipe, model, runtime.total_ranks())",
             ["tests/training/test_recipe_accumulation.py::test_scale_lr_counts_the_workers_not_the_parameter_servers"]),
    Mutation("metric-mean-counts-servers", 'all_reduce_metric("mean") divides by every rank, servers included',
             "src/ddtrain/training/metrics.py", "    return Placement.group, dist.get_world_size(Placement.group)",
             "    return Placement.group, dist.get_world_size()",
             ["tests/sync/test_ps_dropin.py::test_ps_async_counts_workers_follows_the_workers_lr_and_serves_two_models"]),
    Mutation("released-lock-taken-over", "a released checkpoint-directory lock is reported as a crashed run's",
             "src/ddtrain/reliability/ownership.py",
             '    if previous and not previous.get("released") and not _ours(previous):',
             '    if previous and not _ours(previous):',
             ["tests/reliability/test_ownership.py::test_a_released_lock_is_free_and_not_reported_as_a_crashed_runs"]),
    Mutation("watchdog-clock-never-restarts", "the progress watchdog never restarts its clock: long healthy jobs "
             "are killed as stalled", "src/ddtrain/reliability/watchdog.py",
             "                seen, since = now, time.monotonic()", "                seen = now",
             ["tests/reliability/test_watchdog.py::test_a_healthy_run_longer_than_the_deadline_is_never_called_stalled"]),
    Mutation("ps-state-headers-first", "a ps worker waits for every server's STATE header before taking any bytes "
             "(the ordering that deadlocked, before 969b02f)", "src/ddtrain/sync/ps/worker.py",
             '        self.exchange(STATE, "optimizer state", on_state=receive)\n',
             "        later = []   # every header first, then the bytes: the ordering before 969b02f\n"
             '        self.exchange(STATE, "optimizer state", on_state=lambda s, server: later.append((s, server)))\n'
             "        for s, server in later:\n            receive(s, server)\n",
             ["tests/sync/test_ps_state_order.py"]),
    Mutation("excepthook-innermost-frame", "the excepthook keys errors by the innermost frame only",
             "src/ddtrain/distributed/excepthook.py",
             '    frames = [f"{f.filename}:{f.lineno}:{f.name}" for f in traceback.extract_tb(tb)]',
             '    frames = [f"{f.filename}:{f.lineno}:{f.name}" for f in traceback.extract_tb(tb)[-1:]]',
             ["tests/distributed/test_excepthook.py::test_the_same_line_reached_through_another_call_chain_is_another_error"]),
    Mutation("adviser-tie-break", "the adviser breaks a tie in step time by label, not by fewer bytes",
             "src/ddtrain/costmodel/advise.py",
             "    return sorted(predictions, key=lambda p: (p.step_s, p.bytes_per_step, p.method.label))",
             "    return sorted(predictions, key=lambda p: (p.step_s, p.method.label))",
             ["tests/costmodel/test_advise_model.py::test_rank_breaks_a_tie_in_time_by_fewer_bytes_then_by_label"]),
    Mutation("central-reduction-order", "central folds the buffers in reverse rank order, not the documented one",
             "src/ddtrain/comm/central.py", "        for buf in incoming:", "        for buf in reversed(incoming):",
             ["tests/comm/test_comm_allreduce.py::test_central_reduces_in_rank_order_as_documented"]),
    Mutation("sync-batchnorm-not-converted", "sync_batchnorm=True is accepted and no layer is converted",
             "src/ddtrain/sync/ddp.py", "        sync_batchnorm_(model)\n", "        pass  # no conversion\n",
             ["tests/training/test_prepare_types.py::test_sync_batchnorm_hands_ddp_a_model_whose_batchnorm_layers_are_"
              "converted"]),
    Mutation("resume-schedule-change-unchecked", "a resume under other schedule settings (--steps 17 -> 30, cosine) "
             "trains on silently", "src/ddtrain/reliability/checkpoint.py",
             "        if change and not self.allow_schedule_change:\n", "        if change and self.allow_schedule_change:\n",
             [CHECKPOINT + "test_a_resume_that_changes_the_schedule_is_refused_naming_the_setting"]),
]
for _m in ISSUE_31:
    _m.audit = "issue-31"
MUTATIONS += ISSUE_31


def copy_repository(source: str, into: Path) -> str:
    """src/ and tests/ (and pyproject.toml) of HEAD or of the working tree, under ``into``; says which."""
    into.mkdir(parents=True)
    if source == "HEAD":
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        archive = subprocess.run(["git", "archive", "HEAD", "src", "tests", "pyproject.toml"], cwd=REPO,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        described = f"HEAD {commit}"
    else:
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
        for name in ("src", "tests"):
            shutil.copytree(REPO / name, into / name, ignore=ignore)
        shutil.copy2(REPO / "pyproject.toml", into / "pyproject.toml")
        described = "working tree"
    shared = REPO.parent / "shared"          # tests find the shared data beside the repository
    if shared.is_dir() and not (into.parent / "shared").exists():
        (into.parent / "shared").symlink_to(shared)
    return described


def run_pytest(copy: Path, tests: list[str], timeout_s: float, markers: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(copy / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("RANK", None)
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               *(["-m", markers] if markers else []), *tests],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = None, f"timed out after {timeout_s:g} s\n{exc.stdout or ''}"
    seconds = time.monotonic() - start
    lines = [line for line in output.splitlines() if line.strip()]
    summary = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)),
                   lines[-1] if lines else "")
    failed = [line.split(" - ")[0][len("FAILED "):] for line in lines if line.startswith("FAILED ")]
    return {"exit_code": code, "summary": summary, "failed": failed, "seconds": round(seconds, 1),
            "output_tail": "\n".join(lines[-15:])}


def check(mutation: Mutation, copy: Path, timeout_s: float, repeat: int = 1, markers: str | None = None,
          tests: list[str] | None = None) -> dict:
    tests = tests or mutation.tests
    row = {"name": mutation.name, "what": mutation.what, "file": mutation.file, "tests": tests,
           "audit": mutation.audit}
    if not mutation.tests or not mutation.old:
        return {**row, "outcome": "pending", "caught": None, "seconds": 0.0,
                "summary": "no test for it yet"}
    path = copy / mutation.file
    text = path.read_text() if path.exists() else ""
    if text.count(mutation.old) != 1:
        return {**row, "outcome": "patch does not apply", "caught": None, "seconds": 0.0,
                "summary": f"the old snippet occurs {text.count(mutation.old)} times in {mutation.file}"}
    missing = [t for t in tests if not (copy / t.split("::")[0]).exists()]
    if missing:
        return {**row, "outcome": "pending", "caught": None, "seconds": 0.0,
                "summary": f"test file missing: {', '.join(missing)}"}
    path.write_text(text.replace(mutation.old, mutation.new))
    runs = []
    try:
        for _ in range(repeat):       # a bug that shows only in some interleavings must be caught on every run
            result = run_pytest(copy, tests, timeout_s, markers)
            code = result["exit_code"]
            runs.append("caught" if code == 1 and result["failed"] else "survived" if code == 0 else "error")
    finally:
        path.write_text(text)
    outcome = runs[0] if len(set(runs)) == 1 else "survived" if "survived" in runs else "error"
    if repeat > 1:
        result = {**result, "runs": runs, "summary": f"caught {runs.count('caught')} of {repeat} runs; last: "
                                                     f"{result['summary']}"}
    return {**row, **result, "outcome": outcome, "caught": outcome == "caught"}


def table(rows: list[dict]) -> str:
    out = ["# mutation                              audit     tests  caught   seconds",
           "#                                       (before)  (run)  (now)    (s)"]
    for r in rows:
        caught = {"caught": "yes", "survived": "NO", "pending": "pending"}.get(r["outcome"], r["outcome"])
        out.append(f"  {r['name']:<38}{r['audit']:<10}{len(r['tests']):>5}  {caught:<8}{r['seconds']:>8.1f}")
    counted = [r for r in rows if r["outcome"] in ("caught", "survived")]
    errors = [r for r in rows if r["outcome"] == "error"]
    out.append(f"# caught {sum(r['outcome'] == 'caught' for r in rows)} of {len(counted)} run; "
               f"{len(errors)} ended in an error (not a catch); "
               f"{len(rows) - len(counted) - len(errors)} not run (pending, or the patch does not apply)")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="mutation names (default: all)")
    parser.add_argument("--source", choices=("HEAD", "worktree"), default="HEAD",
                        help="copy the last commit (default) or the working tree as it is")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    parser.add_argument("--tests", nargs="*", help="run these tests instead of each mutation's own")
    parser.add_argument("-m", dest="markers", help="pytest's -m (e.g. slow, for a slow test named with --tests)")
    parser.add_argument("--repeat", type=int, default=1, help="run each mutation's tests this many times; caught "
                        "only when every run fails (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help="the JSON table (default: %(default)s)")
    parser.add_argument("--list", action="store_true", help="print each mutation and its tests, run nothing")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.only or [] if n not in known]
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(unknown)}; valid: {', '.join(known)}")
    selected = [known[n] for n in args.only] if args.only else MUTATIONS
    if args.list:
        for m in selected:
            print(f"{m.name} ({m.audit} in the audit): {m.what}\n  {m.file}\n  - {m.old.strip()!r}\n"
                  f"  + {m.new.strip()!r}\n  tests: {' '.join(m.tests) or '(pending)'}")
        return 0
    with tempfile.TemporaryDirectory(prefix="ddtrain-mutations-") as tmp:
        copy = Path(tmp) / "repo"
        described = copy_repository(args.source, copy)
        print(f"# mutations against a copy of {described} in {copy}", flush=True)
        baseline = None
        if not args.no_baseline:
            union = list(dict.fromkeys(t for m in selected for t in (args.tests or m.tests)
                                       if (copy / t.split("::")[0]).exists()))
            baseline = run_pytest(copy, union, args.timeout, args.markers)
            print(f"# baseline (no mutation, {len(union)} test selections): {baseline['summary']} "
                  f"in {baseline['seconds']} s", flush=True)
            if baseline["exit_code"] != 0:
                print(baseline["output_tail"], file=sys.stderr)
                print("mutation_check: error: the unmutated copy fails its tests; fix that first", file=sys.stderr)
                return 1
        rows = []
        for m in selected:
            row = check(m, copy, args.timeout, args.repeat, args.markers, args.tests)
            rows.append(row)
            print(f"#   {m.name}: {row['outcome']} ({row['summary']}, {row['seconds']} s)", flush=True)
    print(table(rows))
    record = {"source": described, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "python": platform.python_version(),
              "torch": _torch_version(), "command": " ".join(["python", "tools/mutation_check.py",
                                                              *(argv if argv is not None else sys.argv[1:])]),
              "baseline": baseline, "mutations": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"# written: {args.out}")
    return 0 if all(r["outcome"] in ("caught", "pending") for r in rows) else 1


def _torch_version() -> str:
    try:
        import torch
        return torch.__version__
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
