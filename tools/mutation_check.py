"""Deliberate bugs against the test suite: each mutation applied to a copy, its targeted tests run, caught or not.

    python tools/mutation_check.py                       # all mutations, a copy of HEAD
    python tools/mutation_check.py --only hybrid-never-broadcasts resume-retrains-from-step-0
    python tools/mutation_check.py --source worktree     # a copy of the working tree instead
    python tools/mutation_check.py --list                # what each mutation changes, and its tests

Issue 21's audit: 19 mutations, of which 13 were caught and 6 survived (the tests passed with
the bug in). Each mutation here is a small textual patch (file, old snippet, new snippet) and the
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
             "src/ddtrain/training/loop.py", "(scaler.scale(loss) if scaler else loss).backward()",
             "(scaler.scale(loss) if scaler else loss * 0.5).backward()",
             ["tests/training/test_train_equivalence.py::test_one_process_equals_the_plain_loop", SYNC_EQ + "[2]"],
             audit="survived"),
    Mutation("resnet-residual-times-0", "the ResNet block's residual branch is multiplied by 0",
             "src/ddtrain/models/resnet.py", "return torch.relu(self.body(x) + self.shortcut(x))",
             "return torch.relu(self.body(x) * 0 + self.shortcut(x))",
             ["tests/models/test_models_function.py"], audit="survived"),
]


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


def run_pytest(copy: Path, tests: list[str], timeout_s: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(copy / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("RANK", None)
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
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


def check(mutation: Mutation, copy: Path, timeout_s: float) -> dict:
    row = {"name": mutation.name, "what": mutation.what, "file": mutation.file, "tests": mutation.tests,
           "audit": mutation.audit}
    if not mutation.tests or not mutation.old:
        return {**row, "outcome": "pending", "caught": None, "seconds": 0.0,
                "summary": "no test for it yet"}
    path = copy / mutation.file
    text = path.read_text() if path.exists() else ""
    if text.count(mutation.old) != 1:
        return {**row, "outcome": "patch does not apply", "caught": None, "seconds": 0.0,
                "summary": f"the old snippet occurs {text.count(mutation.old)} times in {mutation.file}"}
    missing = [t for t in mutation.tests if not (copy / t.split("::")[0]).exists()]
    if missing:
        return {**row, "outcome": "pending", "caught": None, "seconds": 0.0,
                "summary": f"test file missing: {', '.join(missing)}"}
    path.write_text(text.replace(mutation.old, mutation.new))
    try:
        result = run_pytest(copy, mutation.tests, timeout_s)
    finally:
        path.write_text(text)
    code = result["exit_code"]
    outcome = "caught" if code == 1 and result["failed"] else "survived" if code == 0 else "error"
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
            union = list(dict.fromkeys(t for m in selected for t in m.tests
                                       if (copy / t.split("::")[0]).exists()))
            baseline = run_pytest(copy, union, args.timeout)
            print(f"# baseline (no mutation, {len(union)} test selections): {baseline['summary']} "
                  f"in {baseline['seconds']} s", flush=True)
            if baseline["exit_code"] != 0:
                print(baseline["output_tail"], file=sys.stderr)
                print("mutation_check: error: the unmutated copy fails its tests; fix that first", file=sys.stderr)
                return 1
        rows = []
        for m in selected:
            row = check(m, copy, args.timeout)
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
