"""Mutation testing of ddtrain's core packages with cosmic-ray, one source file at a time, each against its own tests.

    pip install -e '.[mutation]'                                      # cosmic-ray, into the environment with torch
    python tools/mutation_run.py --plan                              # mutants per file and package; nothing run
    python tools/mutation_run.py --baselines                         # each file's tests once, timed (for --plan)
    python tools/mutation_run.py src/ddtrain/comm/compression/cast.py   # one file
    python tools/mutation_run.py --package comm/compression          # every file of a package
    python tools/mutation_run.py --package sync --jobs 2             # two files at a time (two copies)
    python tools/mutation_run.py --report                            # results/mutations/campaign.md from the JSONs
    python tools/mutation_run.py --recheck                           # survivors triaged 'test': killed now?

Why cosmic-ray (docs/TESTING.md, "Mutation testing"): it writes each mutant into the source
file on disk and runs an ordinary test command in a subprocess, so every process a test starts
sees the mutant -- the Gloo ranks of ``tests/multirank.py`` (spawned interpreters) and the
``ddtrain`` commands the CLI tests run. mutmut 3 instead switches mutants inside the test
process and picks each mutant's tests from the calls it recorded there, so code that runs only
in the spawned ranks (all of comm/ and sync/) would count as covered by no test.

For each file: the repository (``git archive HEAD`` of ``COPIED``, or the working tree) is copied
to a work folder of its own (the real tree is never touched); the file's tests (``TESTS`` below, a table
kept by hand: the tests that exercise the file, default tier only) are run once unmutated --
they must pass, and their time sets the per-mutant timeout (``--timeout-factor`` x that time,
at least ``--min-timeout`` s); ``cosmic-ray init`` lists the mutants; the ones that cannot be
bugs are marked skipped (``skip_reason``: operators outside ``KEEP``, mutants inside a type
annotation, which ``from __future__ import annotations`` never evaluates, and lines marked
``# pragma: no mutate``); ``cosmic-ray exec`` runs the rest, each against the file's tests with
``pytest -x``. A session is kept in the work folder per commit, so an interrupted run resumes
where it stopped. Each mutant ends killed (the tests failed), timed out (counted as killed: the
suite noticed), survived or incompetent; every survivor is looked up in
``results/mutations/triage.json`` (equivalent, with the one-line argument, or the test that now
kills it). Results: ``results/mutations/<package>.json`` (one entry per file, replaced when the
file is rerun) and the table ``results/mutations/campaign.md``.

Score = (killed + timed out) / (killed + timed out + survived - survivors triaged equivalent).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results" / "mutations"
TRIAGE = RESULTS / "triage.json"
BASELINES = RESULTS / "baselines.json"   # each test selection's unmutated time (--baselines), for --plan's estimate
WORKDIR = REPO / ".mutation"          # ignored by git (.gitignore): copies and sessions, per commit

# ---- which tests exercise which file (default tier only; every path relative to the repository) ----
T_ALLREDUCE = "tests/comm/test_comm_allreduce.py"
T_TRAFFIC = "tests/comm/test_comm_traffic.py"
T_PRIMITIVES = "tests/comm/test_comm_primitives.py"
T_COMPRESSION = "tests/comm/test_compression_methods.py"
T_COMPRESSED_SYNC = "tests/sync/test_compression_strategies.py"
T_COSTMODEL = "tests/costmodel/test_costmodel.py"
T_ADVISE = ["tests/costmodel/test_advise_model.py", "tests/costmodel/test_advise_overlap.py",
            "tests/costmodel/test_advise_terms.py"]
T_EQUIVALENCE = "tests/sync/test_sync_equivalence.py"
T_PS = ["tests/sync/test_ps_dropin.py", "tests/sync/test_ps_state_order.py", "tests/sync/test_compression_ps.py",
        "tests/sync/test_sync_traffic.py", T_EQUIVALENCE]
T_RESUME = ["tests/reliability/test_checkpoint.py", "tests/reliability/test_checkpoint_edits.py",
            "tests/reliability/test_resume_not_retrained.py", "tests/reliability/test_strategy_state_resume.py",
            "tests/reliability/test_elastic_resume.py", "tests/reliability/test_schedules.py"]
T_PREPARE = ["tests/training/test_prepare_types.py", "tests/training/test_prepare_multirank.py",
             "tests/training/test_prepare_equivalence.py", "tests/training/test_minimal_path.py"]
ALGORITHM_TESTS = [T_ALLREDUCE, T_TRAFFIC, T_COSTMODEL]

TESTS: dict[str, list[str]] = {
    # comm: the collectives against torch's, their traffic and cost formulas
    "src/ddtrain/comm/__init__.py": [T_ALLREDUCE, T_PRIMITIVES],
    "src/ddtrain/comm/algorithm.py": ALGORITHM_TESTS,
    "src/ddtrain/comm/butterfly.py": ALGORITHM_TESTS,
    "src/ddtrain/comm/central.py": ALGORITHM_TESTS,
    "src/ddtrain/comm/native.py": ALGORITHM_TESTS,
    "src/ddtrain/comm/ops.py": [T_ALLREDUCE, T_PRIMITIVES],
    "src/ddtrain/comm/p2p.py": [T_ALLREDUCE, T_PRIMITIVES, T_TRAFFIC],
    "src/ddtrain/comm/primitives.py": [T_PRIMITIVES],
    "src/ddtrain/comm/ring.py": ALGORITHM_TESTS,
    "src/ddtrain/comm/ring_async.py": ALGORITHM_TESTS,
    "src/ddtrain/comm/traffic.py": [T_TRAFFIC, "tests/sync/test_sync_traffic.py"],
    "src/ddtrain/comm/tree.py": ALGORITHM_TESTS,
    # comm/compression: each method against a reference written from its paper, and torch's hooks
    "src/ddtrain/comm/compression/__init__.py": [T_COMPRESSION, T_COMPRESSED_SYNC,
                                                 "tests/reliability/test_compressor_resume.py"],   # merge_states
    "src/ddtrain/comm/compression/cast.py": [T_COMPRESSION, T_COMPRESSED_SYNC],
    "src/ddtrain/comm/compression/powersgd.py": [T_COMPRESSION, T_COMPRESSED_SYNC,
                                                 "tests/reliability/test_compressor_resume.py"],   # its Q checks
    "src/ddtrain/comm/compression/topk.py": [T_COMPRESSION, T_COMPRESSED_SYNC],
    "src/ddtrain/comm/compression/volume.py": [T_COMPRESSION, "tests/costmodel/test_advise_model.py"],
    # sync: every strategy against a plain loop, its traffic, its own behaviours
    "src/ddtrain/sync/__init__.py": ["tests/sync/test_registration.py", "tests/training/test_strategy_options.py",
                                     "tests/training/test_prepare_types.py", T_EQUIVALENCE],
    "src/ddtrain/sync/accounting.py": ["tests/sync/test_sync_traffic.py", "tests/sync/test_ps_async_order.py"],
    "src/ddtrain/sync/allreduce.py": [T_EQUIVALENCE, "tests/sync/test_sync_traffic.py", T_COMPRESSED_SYNC],
    "src/ddtrain/sync/base.py": ["tests/training/test_strategy_options.py", "tests/sync/test_registration.py",
                                T_EQUIVALENCE],
    "src/ddtrain/sync/ddp.py": ["tests/training/test_prepare_types.py", T_EQUIVALENCE, T_COMPRESSED_SYNC],
    "src/ddtrain/sync/divergence.py": ["tests/sync/test_sync_divergence.py", "tests/sync/test_diloco.py"],
    "src/ddtrain/sync/hybrid.py": ["tests/sync/test_hybrid_broadcasts.py", T_EQUIVALENCE,
                                   "tests/reliability/test_strategy_state_resume.py"],
    "src/ddtrain/sync/local_sgd.py": ["tests/sync/test_diloco.py", T_EQUIVALENCE,
                                      "tests/reliability/test_strategy_state_resume.py"],
    "src/ddtrain/sync/periodic.py": ["tests/sync/test_diloco.py", "tests/sync/test_hybrid_broadcasts.py",
                                     "tests/reliability/test_strategy_state_resume.py"],
    "src/ddtrain/sync/spec.py": ["tests/sync/test_registration.py", "tests/training/test_strategy_options.py"],
    "src/ddtrain/sync/state.py": ["tests/sync/test_hybrid_broadcasts.py", "tests/sync/test_diloco.py"],
    "src/ddtrain/sync/ps/__init__.py": T_PS,
    "src/ddtrain/sync/ps/protocol.py": T_PS,
    "src/ddtrain/sync/ps/serve_async.py": ["tests/sync/test_ps_async_order.py", "tests/sync/test_ps_dropin.py"],
    "src/ddtrain/sync/ps/serve_sync.py": T_PS,
    "src/ddtrain/sync/ps/server.py": [*T_PS, "tests/sync/test_ps_async_order.py"],
    "src/ddtrain/sync/ps/strategy.py": T_PS,
    "src/ddtrain/sync/ps/worker.py": T_PS,
    # reliability: resumes against uninterrupted runs, faults, locks, stalls
    "src/ddtrain/reliability/checkpoint.py": T_RESUME,
    "src/ddtrain/reliability/checkpoint_elastic.py": ["tests/reliability/test_elastic_resume.py"],
    "src/ddtrain/reliability/checkpoint_info.py": ["tests/reliability/test_checkpoint_info.py"],
    "src/ddtrain/reliability/config.py": ["tests/reliability/test_checkpoint.py", "tests/reliability/test_guard.py",
                                          "tests/cli/test_config_files.py"],
    "src/ddtrain/reliability/consistency.py": ["tests/reliability/test_guard.py", "tests/reliability/test_checkpoint.py",
                                               "tests/reliability/test_elastic_resume.py"],
    "src/ddtrain/reliability/faults.py": ["tests/reliability/test_guard.py", "tests/training/test_callbacks.py"],
    "src/ddtrain/reliability/nonfinite.py": ["tests/reliability/test_guard.py"],
    "src/ddtrain/reliability/outputs.py": ["tests/reliability/test_outputs.py"],
    "src/ddtrain/reliability/ownership.py": ["tests/reliability/test_ownership.py"],
    "src/ddtrain/reliability/regular_files.py": ["tests/reliability/test_ownership.py",
                                                 "tests/reliability/test_checkpoint_header.py",
                                                 "tests/cli/test_config_files.py"],
    "src/ddtrain/reliability/replicas.py": ["tests/reliability/test_guard.py", "tests/reliability/test_schedules.py"],
    "src/ddtrain/reliability/stall.py": ["tests/reliability/test_stall_ranks.py", "tests/reliability/test_watchdog.py"],
    "src/ddtrain/reliability/watchdog.py": ["tests/reliability/test_watchdog.py"],
    # training: the loop and recipe against plain PyTorch loops, prepare() against hand-written scripts
    "src/ddtrain/training/build.py": ["tests/training/test_strategy_options.py", "tests/reliability/test_checkpoint.py"],
    "src/ddtrain/training/callbacks.py": ["tests/training/test_callbacks.py"],
    "src/ddtrain/training/compiled.py": ["tests/training/test_train_equivalence.py"],
    "src/ddtrain/training/evaluate.py": ["tests/data/test_validation_metrics.py",
                                         "tests/training/test_train_equivalence.py"],
    "src/ddtrain/training/loop.py": ["tests/training/test_train_equivalence.py",
                                     "tests/training/test_recipe_accumulation.py", "tests/training/test_callbacks.py",
                                     "tests/reliability/test_checkpoint.py",
                                     "tests/reliability/test_resume_not_retrained.py"],
    "src/ddtrain/training/metrics.py": ["tests/training/test_prepare_multirank.py", "tests/sync/test_ps_dropin.py"],
    "src/ddtrain/training/prepare.py": T_PREPARE,
    "src/ddtrain/training/prepared_loader.py": T_PREPARE,
    "src/ddtrain/training/prepared_model.py": T_PREPARE,
    "src/ddtrain/training/prepared_optimizer.py": T_PREPARE,
    "src/ddtrain/training/progress.py": ["tests/training/test_progress.py"],
    "src/ddtrain/recipe/__init__.py": ["tests/recipe/test_recipe.py", "tests/training/test_recipe_accumulation.py",
                                       "tests/reliability/test_checkpoint.py"],
    "src/ddtrain/recipe/config.py": ["tests/recipe/test_recipe.py", "tests/test_config_metadata.py"],
    # modules added since the table was written (issues 28, 29)
    "src/ddtrain/comm/compression/memory.py": ["tests/reliability/test_compressor_resume.py",
                                               "tests/comm/test_compression_methods.py"],
    "src/ddtrain/reliability/preemption.py": ["tests/reliability/test_preemption.py",
                                              "tests/training/test_preemption_loop.py"],
    "src/ddtrain/sync/buffers.py": ["tests/training/test_prepare_idioms.py"],
    "src/ddtrain/sync/ps/guard.py": ["tests/sync/test_ps_script_collectives.py"],
    "src/ddtrain/training/schedules.py": ["tests/training/test_prepare_idioms.py"],
    "src/ddtrain/training/state.py": ["tests/training/test_state.py"],
    # modules added in round 4 (issues 33-36)
    "src/ddtrain/comm/shards.py": ["tests/sync/test_zero.py"],
    "src/ddtrain/costmodel/codecs.py": ["tests/cli/test_advise_cli.py", "tests/sync/test_auto.py"],
    "src/ddtrain/sync/auto.py": ["tests/sync/test_auto.py"],
    "src/ddtrain/sync/fsdp.py": ["tests/sync/test_zero.py", "tests/sync/test_sharding_prepare.py"],
    "src/ddtrain/sync/hook.py": ["tests/sync/test_comm_hook.py", T_EQUIVALENCE],
    "src/ddtrain/sync/memory.py": ["tests/sync/test_zero.py"],
    "src/ddtrain/sync/zero.py": ["tests/sync/test_zero.py", "tests/sync/test_sharding_prepare.py",
                                "tests/reliability/test_sharding_resume.py"],
    "src/ddtrain/training/balance.py": ["tests/training/test_balance.py"],
    # costmodel: Table 5.1 and the published figures, the adviser's terms by hand
    "src/ddtrain/costmodel/__init__.py": [T_COSTMODEL, *T_ADVISE],
    "src/ddtrain/costmodel/advise.py": T_ADVISE,
    "src/ddtrain/costmodel/alphabeta.py": [T_COSTMODEL],
    "src/ddtrain/costmodel/burst.py": T_ADVISE,
    "src/ddtrain/costmodel/calibration.py": [T_COSTMODEL],
    "src/ddtrain/costmodel/contention.py": T_ADVISE,
    "src/ddtrain/costmodel/counts.py": [T_COSTMODEL],
    "src/ddtrain/costmodel/loaded.py": T_ADVISE,
    "src/ddtrain/costmodel/overlap.py": T_ADVISE,
    "src/ddtrain/costmodel/risks.py": T_ADVISE,
    "src/ddtrain/costmodel/schedule.py": T_ADVISE,
}

# one result file per package; a file belongs to the longest prefix it starts with
PACKAGES = {"comm/compression": "src/ddtrain/comm/compression/", "comm": "src/ddtrain/comm/",
            "sync": "src/ddtrain/sync/", "reliability": "src/ddtrain/reliability/",
            "training": "src/ddtrain/training/", "recipe": "src/ddtrain/recipe/", "costmodel": "src/ddtrain/costmodel/"}

# issue 31's acceptance: a score of at least 85 % on these (``--plan`` prints their subtotal)
ACCEPTANCE = {"comm/compression": ("src/ddtrain/comm/compression/",), "sync": ("src/ddtrain/sync/",),
              "reliability/checkpoint*": ("src/ddtrain/reliability/checkpoint",),
              # training/recipe.py became the package recipe/ (issue 27): its code is recipe/__init__.py
              "training/loop.py, recipe": ("src/ddtrain/training/loop.py", "src/ddtrain/recipe/__init__.py")}

# ---- which of cosmic-ray's operators run: one plausible slip per site, as a person would make it ----
# cosmic-ray replaces every binary operator by each of the other 11 and every comparison by each of
# the other 7; most of those (a + b -> a << b) are bugs nobody writes and every test kills, and they
# multiply the cost tenfold. Kept: the neighbour a slip gives (+ <-> -, * <-> /, < <-> <=, == <-> !=,
# is <-> is not, and <-> or), the boundary and sign flips, and every non-operator mutation.
BINARY = {"Add": "Sub", "Sub": "Add", "Mul": "Div", "Div": "Mul", "FloorDiv": "Div", "Mod": "FloorDiv",
          "Pow": "Mul", "LShift": "RShift", "RShift": "LShift", "BitAnd": "BitOr", "BitOr": "BitAnd",
          "BitXor": "BitOr", "MatMul": "Mul"}
COMPARISON = {"Eq": "NotEq", "NotEq": "Eq", "Lt": "LtE", "LtE": "Lt", "Gt": "GtE", "GtE": "Gt", "Is": "IsNot",
              "IsNot": "Is"}
UNARY = {("USub", "UAdd"), ("Delete", "Not"), ("Invert", "USub")}


def kept(operator: str) -> bool:
    """Is cosmic-ray's ``operator`` (e.g. ``core/ReplaceBinaryOperator_Add_Sub``) one of the slips run here?"""
    name = operator.split("/")[-1]
    if m := re.fullmatch(r"ReplaceBinaryOperator_(\w+?)_(\w+)", name):
        return BINARY.get(m[1]) == m[2]
    if m := re.fullmatch(r"ReplaceComparisonOperator_(\w+?)_(\w+)", name):
        return COMPARISON.get(m[1]) == m[2]
    if m := re.fullmatch(r"ReplaceUnaryOperator_(\w+?)_(\w+)", name):
        return (m[1], m[2]) in UNARY
    return True


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((line, column), (end line, end column)) of every type annotation (columns in characters, as parso's)."""
    lines = source.splitlines()

    def char_col(line: int, byte_col: int) -> int:
        return len(lines[line - 1].encode()[:byte_col].decode(errors="ignore")) if line <= len(lines) else byte_col

    spans = []
    for node in ast.walk(ast.parse(source)):
        notes = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            notes.append(node.returns)
        elif isinstance(node, ast.arg) and node.annotation is not None:
            notes.append(node.annotation)
        elif isinstance(node, ast.AnnAssign):
            notes.append(node.annotation)
        for a in notes:
            spans.append(((a.lineno, char_col(a.lineno, a.col_offset)),
                          (a.end_lineno, char_col(a.end_lineno, a.end_col_offset))))
    return spans


def skip_reason(mutation: dict, source_lines: list[str], annotations) -> str | None:
    """Why a mutant is not run (None: it runs). ``annotations``: ``annotation_spans``, or [] where they run."""
    if not kept(mutation["operator_name"]):
        return "operator not run (one slip per site: BINARY, COMPARISON, UNARY)"
    start, end = tuple(mutation["start_pos"]), tuple(mutation["end_pos"])
    if any(a <= start and end <= b for a, b in annotations):
        return "equivalent: inside a type annotation (never evaluated under from __future__ import annotations)"
    line = source_lines[start[0] - 1] if start[0] <= len(source_lines) else ""
    if "BinaryOperator_Mul_" in mutation["operator_name"] and \
            re.fullmatch(r".*[(,]\s*", line[:start[1]]) and re.match(r"\*\s*[,)]", line[start[1]:]):
        return "not an operator: the keyword-only marker * of a signature (parso reads it as a product)"
    if re.search(r"#.*pragma:.*no mutate", line):
        return "line marked # pragma: no mutate"
    return None


def file_filters(source: str) -> tuple[list[str], list]:
    """(the file's lines, the annotation spans ``skip_reason`` skips: none unless annotations are never evaluated)."""
    lazy = re.search(r"^from __future__ import annotations", source, re.M) is not None
    return source.splitlines(), annotation_spans(source) if lazy else []


# ---- running ----

def package_of(path: str) -> str:
    return max((p for p, prefix in PACKAGES.items() if path.startswith(prefix)), key=len)


def commit_of(source: str) -> str:
    if source == "worktree":
        return "worktree"
    return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


COPIED = ("src", "tests", "examples", "benchmarks", "tools", "pyproject.toml")   # what tests read (not results/)


def copy_repository(source: str, into: Path) -> None:
    """``COPIED`` of HEAD or of the working tree into ``into`` (and the shared data beside it)."""
    if into.exists():
        return
    into.mkdir(parents=True)
    if source == "HEAD":
        archive = subprocess.run(["git", "archive", "HEAD", *COPIED], cwd=REPO, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    else:
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
        for name in COPIED:
            if (REPO / name).is_dir():
                shutil.copytree(REPO / name, into / name, ignore=ignore)
            else:
                shutil.copy2(REPO / name, into / name)
    shared = REPO.parent / "shared"          # tests find the shared data beside the repository
    if shared.is_dir() and not (into.parent / "shared").exists():
        (into.parent / "shared").symlink_to(shared)


def test_command(python: str, tests: list[str]) -> list[str]:
    return [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]


def environment(copy: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(copy / "src"), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return env


def cosmic_ray(python: str, *args, cwd: Path, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([python, "-m", "cosmic_ray.cli", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"cosmic-ray {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


def sessions(python: str, copy: Path, session: Path, env: dict) -> list[tuple[dict, dict | None]]:
    """(work item, result or None) of every mutant of ``session`` (``cosmic-ray dump``)."""
    out = cosmic_ray(python, "dump", str(session), cwd=copy, env=env).stdout
    return [tuple(json.loads(line)) for line in out.splitlines() if line.strip()]


def mark_skipped(session: Path, reasons: dict[str, str]) -> None:
    """Record ``reasons`` (job id -> why) as skipped results, as cosmic-ray's own filters do."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult
    with use_db(str(session), WorkDB.Mode.open) as db:
        for job_id, why in reasons.items():
            db.set_result(job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=why))


def outcome(result: dict | None) -> str:
    """killed, timed out, survived, incompetent, skipped, error or pending."""
    if result is None:
        return "pending"
    worker = result.get("worker_outcome")
    if worker == "skipped":
        return "skipped"
    if worker != "normal":
        return "error"
    test = result.get("test_outcome")
    if test == "killed":
        return "timed out" if (result.get("output") or "").strip() == "timeout" else "killed"
    return {"survived": "survived", "incompetent": "incompetent"}.get(test, "error")


def load_triage() -> list[dict]:
    return json.loads(TRIAGE.read_text())["survivors"] if TRIAGE.exists() else []


def triage_for(file: str, operator: str, line_text: str, triage: list[dict]) -> dict | None:
    """The triage entry of a survivor: matched on its file, operator and the text of its line (not the line number,
    which moves with every edit above it)."""
    for entry in triage:
        if entry["file"] == file and entry["operator"] == operator and entry["line"].strip() == line_text.strip():
            return entry
    return None


def run_file(path: str, args) -> dict:
    """Mutate ``path``, run its tests per mutant; its row for ``results/mutations/<package>.json``."""
    tests = TESTS[path]
    base = args.workdir / commit_of(args.source) / path.replace("/", "_")
    copy, session = base / "repo", base / "session.sqlite"
    copy_repository(args.source, copy)
    env = environment(copy)
    started = time.monotonic()
    baseline_start = time.monotonic()
    done = subprocess.run(test_command(args.python, tests), cwd=copy, env=env, capture_output=True, text=True)
    baseline_s = time.monotonic() - baseline_start
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode != 0:
        raise RuntimeError(f"{path}: its tests fail without any mutation ({summary}); fix that first:\n"
                           f"{done.stdout[-3000:]}{done.stderr[-2000:]}")
    timeout_s = max(args.min_timeout, args.timeout_factor * baseline_s)
    config = copy / "cosmic-ray.toml"
    config.write_text(f'[cosmic-ray]\nmodule-path = "{path}"\ntimeout = {timeout_s:.0f}.0\nexcluded-modules = []\n'
                      f"test-command = {json.dumps(' '.join(test_command(args.python, tests)))}\n\n"
                      '[cosmic-ray.distributor]\nname = "local"\n')
    if not session.exists():
        cosmic_ray(args.python, "init", str(config), str(session), cwd=copy, env=env)
        lines, spans = file_filters((copy / path).read_text())
        reasons = {}
        for item, _ in sessions(args.python, copy, session, env):
            why = skip_reason(item["mutations"][0], lines, spans)
            if why:
                reasons[item["job_id"]] = why
        mark_skipped(session, reasons)
    print(f"# {path}: baseline {summary} in {baseline_s:.1f} s; per-mutant timeout {timeout_s:.0f} s", flush=True)
    cosmic_ray(args.python, "exec", str(config), str(session), cwd=copy, env=env)
    return summarise(path, tests, copy, session, env, args, baseline_s, timeout_s, time.monotonic() - started)


def summarise(path, tests, copy, session, env, args, baseline_s, timeout_s, took_s) -> dict:
    source_lines = (copy / path).read_text().splitlines()
    triage = load_triage()
    counts = dict.fromkeys(("killed", "timed out", "survived", "incompetent", "error", "pending", "skipped"), 0)
    skipped_why: dict[str, int] = {}
    survivors = []
    for item, result in sessions(args.python, copy, session, env):
        mutation = item["mutations"][0]
        kind = outcome(result)
        counts[kind] += 1
        if kind == "skipped":
            why = (result.get("output") or "").split(":")[0]
            skipped_why[why] = skipped_why.get(why, 0) + 1
        if kind == "survived":
            line = mutation["start_pos"][0]
            text = source_lines[line - 1] if line <= len(source_lines) else ""
            survivors.append({"operator": mutation["operator_name"], "occurrence": mutation["occurrence"],
                              "line": line, "source": text.strip(), "diff": result.get("diff"),
                              "triage": triage_for(path, mutation["operator_name"], text, triage)})
    row = {"file": path, "tests": tests, "baseline_s": round(baseline_s, 1), "timeout_s": round(timeout_s),
           "run_s": round(took_s, 1), "mutants": sum(counts.values()) - counts["skipped"], **counts,
           "skipped_why": skipped_why, "survivors": survivors}
    return apply_triage(row, triage)


def apply_triage(row: dict, triage: list[dict]) -> dict:
    """Look each survivor of ``row`` up in the triage (again: ``--report`` reapplies an edited triage.json) and
    count the equivalent ones, the untriaged ones and the score."""
    for s in row["survivors"]:
        s["triage"] = triage_for(row["file"], s["operator"], s["source"], triage)
    row["equivalent"] = sum(1 for s in row["survivors"] if s["triage"] and s["triage"]["verdict"] == "equivalent")
    row["untriaged"] = sum(1 for s in row["survivors"] if not s["triage"])
    detected = row["killed"] + row["timed out"]
    scored = detected + row["survived"] - row["equivalent"]
    row["score"] = round(detected / scored, 4) if scored else None
    return row


def write_package(package: str, rows: list[dict], args) -> Path:
    out = RESULTS / f"{package.replace('/', '-')}.json"
    record = json.loads(out.read_text()) if out.exists() else {"package": package, "files": {}}
    record.update({"package": package, "tool": f"cosmic-ray {_version('cosmic-ray')}", "source": args.source,
                   "commit": commit_of(args.source),
                   "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "machine": f"{platform.machine()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
                   "python": platform.python_version(), "torch": _version("torch")})
    for row in rows:
        record["files"][row["file"]] = row
    record["files"] = dict(sorted(record["files"].items()))
    record["total"] = total(record["files"].values())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out


def total(rows) -> dict:
    keys = ("mutants", "killed", "timed out", "survived", "incompetent", "error", "pending", "skipped", "equivalent",
            "untriaged")
    out = {k: sum(r[k] for r in rows) for k in keys}
    detected = out["killed"] + out["timed out"]
    scored = detected + out["survived"] - out["equivalent"]
    out["score"] = round(detected / scored, 4) if scored else None
    return out


def report() -> str:
    """The per-package and per-file table of every ``results/mutations/<package>.json``."""
    lines = ["# Mutation testing: results per package (tools/mutation_run.py, cosmic-ray)", "",
             "Score = (killed + timed out) / (killed + timed out + survived - equivalent). "
             "Each row names the JSON it comes from.", "",
             "| package / file | files run | mutants | killed | timed out | survived | equivalent | untriaged "
             "| incompetent | score | commit | from |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for package in PACKAGES:
        path = RESULTS / f"{package.replace('/', '-')}.json"
        in_package = sum(1 for f in TESTS if package_of(f) == package)
        if not path.exists():
            lines.append(f"| **{package}** | 0 of {in_package} | not run yet | | | | | | | | | |")
            continue
        record = json.loads(path.read_text())
        for name, row, files in [(f"**{package}**", record["total"], f"{len(record['files'])} of {in_package}"),
                                 *((f"`{f.removeprefix('src/ddtrain/')}`", r, "") for f, r in record["files"].items())]:
            score = f"{100 * row['score']:.1f} %" if row["score"] is not None else "-"
            lines.append(f"| {name} | {files} | {row['mutants']} | {row['killed']} | {row['timed out']} | {row['survived']} | "
                         f"{row['equivalent']} | {row['untriaged']} | {row['incompetent']} | {score} | "
                         f"{record['commit']} | results/mutations/{path.name} |")
    missing = [p for p in PACKAGES if not (RESULTS / f"{p.replace('/', '-')}.json").exists()]
    if missing:
        lines += ["", f"Not run yet: {', '.join(missing)} (commands in docs/TESTING.md)."]
    return "\n".join(lines) + "\n"


def apply_mutation(source: str, diff: str) -> str | None:
    """``source`` with the one hunk of a cosmic-ray mutation ``diff`` applied; None where its lines are not found once.

    Done on the text, not by ``patch``: cosmic-ray's diff of a file's last line ends in a removed
    and an added empty line (its end-of-file marker), which ``patch`` refuses; here they cancel.
    """
    old, new = [], []
    for line in diff.splitlines():
        if line.startswith(("---", "+++", "@@")):
            continue
        if line.startswith("-"):
            old.append(line[1:])
        elif line.startswith("+"):
            new.append(line[1:])
        else:
            old.append(line[1:])
            new.append(line[1:])
    before, after = "\n".join(old), "\n".join(new)
    if not before or source.count(before) != 1:
        return None
    return source.replace(before, after)


def recheck(args) -> None:
    """Every survivor triaged ``test`` run again: its diff applied to a copy of HEAD, its file's tests as they are now.

    A triage entry says which test now kills a survivor; this shows it. A survivor the tests now
    fail on moves to the row's ``killed_on_recheck`` (counted killed, with the commit of the
    check); one they still pass stays a survivor with ``recheck`` saying so; a diff that no longer
    applies (the source changed since the run) stays too, marked stale. Only the named files, or
    every file of every package record.
    """
    commit = commit_of("HEAD")
    copy = args.workdir / commit / "recheck" / "repo"
    copy_repository("HEAD", copy)
    env = environment(copy)
    triage = load_triage()
    wanted = set(args.files)
    for package in PACKAGES:
        path = RESULTS / f"{package.replace('/', '-')}.json"
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        changed = False
        for file, row in record["files"].items():
            if wanted and file not in wanted:
                continue
            row = apply_triage(row, triage)
            keep = []
            for s in row["survivors"]:
                if not (s["triage"] and s["triage"]["verdict"] == "test") or not s.get("diff"):
                    keep.append(s)
                    continue
                target = copy / file
                original = target.read_text()
                mutated = apply_mutation(original, s["diff"])
                try:
                    if mutated is None:
                        s["recheck"] = f"stale: the diff no longer applies at {commit}"
                        keep.append(s)
                        continue
                    target.write_text(mutated)
                    limit = max(args.min_timeout, args.timeout_factor * row.get("baseline_s", 0))
                    try:
                        done = subprocess.run(test_command(args.python, TESTS[file]), cwd=copy, env=env,
                                              capture_output=True, text=True, timeout=limit)
                        killed = done.returncode != 0
                    except subprocess.TimeoutExpired:
                        killed = True          # as the run counts a timeout: the suite noticed
                finally:
                    target.write_text(original)
                print(f"#   {file}:{s['line']} {s['operator'].split('/')[-1]}: "
                      f"{'killed' if killed else 'SURVIVED'} at {commit}", flush=True)
                if killed:
                    row["killed"] += 1
                    row["survived"] -= 1
                    row.setdefault("killed_on_recheck", []).append({**s, "recheck_commit": commit})
                else:
                    s["recheck"] = f"survived the tests at {commit}"
                    keep.append(s)
            row["survivors"] = keep
            record["files"][file] = apply_triage(row, triage)
            changed = True
        if changed:
            record["total"] = total(record["files"].values())
            record["rechecked"] = {"commit": commit, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            path.write_text(json.dumps(record, indent=1) + "\n")
            print(f"# written: {path}")
    (RESULTS / "campaign.md").write_text(report())


def measure_baselines(args) -> None:
    """Run each distinct test selection of the selected files once, unmutated; record its time (BASELINES)."""
    import tempfile
    record = json.loads(BASELINES.read_text()) if BASELINES.exists() else {"selections": {}}
    with tempfile.TemporaryDirectory(prefix="ddtrain-mutation-baselines-") as tmp:
        copy = Path(tmp) / "repo"
        copy_repository(args.source, copy)
        for tests in dict.fromkeys(tuple(TESTS[f]) for f in selected(args)):
            start = time.monotonic()
            done = subprocess.run(test_command(args.python, list(tests)), cwd=copy, env=environment(copy),
                                  capture_output=True, text=True)
            seconds = time.monotonic() - start
            summary = (done.stdout.strip().splitlines() or [""])[-1]
            failed = [line.split(" - ")[0].removeprefix("FAILED ") for line in done.stdout.splitlines()
                      if line.startswith("FAILED ")]
            record["selections"][" ".join(tests)] = {
                "seconds": round(seconds, 1), "summary": summary, "exit_code": done.returncode, "failed": failed,
                "commit": commit_of(args.source), "load": round(os.getloadavg()[0], 1),
                "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            print(f"# {seconds:7.1f} s  {summary}  {' '.join(tests)}", flush=True)
    record["machine"] = f"{platform.machine()} {os.cpu_count()} CPUs"
    BASELINES.write_text(json.dumps(record, indent=1) + "\n")


def plan(args) -> None:
    """Mutants per file and package after the filters, without running anything (``cosmic-ray init`` only).

    With a selection's unmutated time in BASELINES: the CPU time its mutants would take at most (every mutant
    running the whole selection; a killed one stops at its first failing test, so a run takes less).
    """
    import tempfile
    rows = []
    known = json.loads(BASELINES.read_text())["selections"] if BASELINES.exists() else {}
    with tempfile.TemporaryDirectory(prefix="ddtrain-mutation-plan-") as tmp:
        copy = Path(tmp) / "repo"
        copy_repository(args.source, copy)
        env = environment(copy)
        print("# file                                              generated   run  tests  baseline_s  at most (h)")
        for path in selected(args):
            config, session = copy / "plan.toml", Path(tmp) / (path.replace("/", "_") + ".sqlite")
            config.write_text(f'[cosmic-ray]\nmodule-path = "{path}"\ntimeout = 1.0\nexcluded-modules = []\n'
                              'test-command = "true"\n\n[cosmic-ray.distributor]\nname = "local"\n')
            cosmic_ray(args.python, "init", str(config), str(session), cwd=copy, env=env)
            lines, spans = file_filters((copy / path).read_text())
            items = sessions(args.python, copy, session, env)
            run = sum(1 for item, _ in items if skip_reason(item["mutations"][0], lines, spans) is None)
            baseline = known.get(" ".join(TESTS[path]), {}).get("seconds")
            hours = run * baseline / 3600 if baseline is not None else None
            print(f"  {path.removeprefix('src/ddtrain/'):<48}{len(items):>9}{run:>6}{len(TESTS[path]):>7}"
                  f"{baseline if baseline is not None else '-':>12}{f'{hours:.1f}' if hours is not None else '-':>13}",
                  flush=True)
            rows.append((path, len(items), run, baseline))
    groups = {p: [r for r in rows if package_of(r[0]) == p] for p in PACKAGES}
    groups.update({f"acceptance: {name}": [r for r in rows if r[0].startswith(prefixes)]
                   for name, prefixes in ACCEPTANCE.items()})
    print("# group: generated, run; files with a baseline (their mutants, hours); the others' mutants at the median "
          "baseline of the group; hours in all")
    for name, group in groups.items():
        if not group:
            continue
        measured = [r for r in group if r[3] is not None]
        median = statistics.median(r[3] for r in measured) if measured else None
        hours = sum(r[2] * r[3] for r in measured) / 3600
        rest = sum(r[2] for r in group if r[3] is None)
        extra = rest * median / 3600 if median else float("nan")
        print(f"# {name}: {sum(r[1] for r in group)} generated, {sum(r[2] for r in group)} run; "
              f"{len(measured)} of {len(group)} files measured ({sum(r[2] for r in measured)} mutants, {hours:.1f} h); "
              f"{rest} others at {f'{median:.1f}' if median is not None else '-'} s ({extra:.1f} h); "
              f"{hours + extra:.1f} h in all")
    print(f"# all: {sum(r[1] for r in rows)} generated, {sum(r[2] for r in rows)} run")


def selected(args) -> list[str]:
    if args.files:
        unknown = [f for f in args.files if f not in TESTS]
        if unknown:
            raise SystemExit(f"mutation_run: no tests listed for {', '.join(unknown)} (add them to TESTS)")
        return args.files
    if args.package:
        prefix = PACKAGES[args.package]
        return [f for f in TESTS if f.startswith(prefix) and package_of(f) == args.package]
    return list(TESTS)


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="source files (default: --package, else every file in TESTS)")
    parser.add_argument("--package", choices=list(PACKAGES), help="every file of one package")
    parser.add_argument("--source", choices=("HEAD", "worktree"), default="HEAD",
                        help="copy the last commit (default) or the working tree as it is")
    parser.add_argument("--jobs", type=int, default=1, help="files mutated at once, each in its own copy")
    parser.add_argument("--timeout-factor", type=float, default=3.0,
                        help="a mutant's tests may run this many times their unmutated time (default: %(default)s)")
    parser.add_argument("--min-timeout", type=float, default=60.0, help="seconds, at least (default: %(default)s)")
    parser.add_argument("--python", default=sys.executable, help="the Python that runs the tests (with torch)")
    parser.add_argument("--workdir", type=Path, default=WORKDIR, help="copies and sessions (default: %(default)s)")
    parser.add_argument("--plan", action="store_true", help="count the mutants per file; run nothing")
    parser.add_argument("--report", action="store_true",
                        help="reapply results/mutations/triage.json and write results/mutations/campaign.md; run nothing")
    parser.add_argument("--recheck", action="store_true",
                        help="run each survivor triaged 'test' again against its tests now (the named files, or all)")
    parser.add_argument("--baselines", action="store_true",
                        help="time each distinct test selection once, unmutated, into results/mutations/baselines.json")
    args = parser.parse_args(argv)
    if args.report:
        triage = load_triage()
        for package in PACKAGES:       # the triage may have changed since the run: reapply it
            path = RESULTS / f"{package.replace('/', '-')}.json"
            if path.exists():
                record = json.loads(path.read_text())
                record["files"] = {f: apply_triage(row, triage) for f, row in record["files"].items()}
                record["total"] = total(record["files"].values())
                path.write_text(json.dumps(record, indent=1) + "\n")
        (RESULTS / "campaign.md").write_text(report())
        print(report())
        return 0
    if _version("cosmic-ray") == "not installed":
        parser.error("cosmic-ray is not installed in this Python: pip install -e '.[mutation]'")
    if args.baselines:
        measure_baselines(args)
        return 0
    if args.recheck:
        recheck(args)
        return 0
    if args.plan:
        plan(args)
        return 0
    files = selected(args)
    rows: dict[str, list[dict]] = {}
    if args.jobs > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda f: run_file(f, args), files))
    else:
        results = [run_file(f, args) for f in files]
    for row in results:
        rows.setdefault(package_of(row["file"]), []).append(row)
        score = f"{100 * row['score']:.1f} %" if row["score"] is not None else "-"
        print(f"# {row['file']}: {row['mutants']} mutants, killed {row['killed']}, timed out {row['timed out']}, "
              f"survived {row['survived']} ({row['equivalent']} equivalent, {row['untriaged']} untriaged), "
              f"score {score}, {row['run_s']:.0f} s", flush=True)
        for s in row["survivors"]:
            verdict = s["triage"]["verdict"] if s["triage"] else "UNTRIAGED"
            print(f"#   line {s['line']} {s['operator'].split('/')[-1]}: {s['source']}  [{verdict}]")
    for package, package_rows in rows.items():
        print(f"# written: {write_package(package, package_rows, args)}")
    (RESULTS / "campaign.md").write_text(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
