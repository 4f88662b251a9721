"""The mutation script stays runnable: every patch applies to today's code, every test it names exists.

``tools/mutation_check.py`` (docs/TESTING.md) is too slow for CI; this checks in
milliseconds what would make it silently useless: a snippet that no longer occurs exactly once
(the patched line moved or changed) or a test file that was renamed.
"""
import ast
import importlib.util
import sys

import pytest

from helpers import REPO

spec = importlib.util.spec_from_file_location("mutation_check", REPO / "tools" / "mutation_check.py")
mutation_check = importlib.util.module_from_spec(spec)
sys.modules["mutation_check"] = mutation_check   # dataclasses look their module up there
spec.loader.exec_module(mutation_check)
MUTATIONS = mutation_check.MUTATIONS


def test_issue_21s_19_mutations_and_issue_31s_22_each_with_its_test():
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS) == 19 + 22
    issue_21 = [m for m in MUTATIONS if m.audit in ("caught", "survived")]
    assert len(issue_21) == 19 and sum(m.audit == "survived" for m in issue_21) == 6
    assert all(m.tests for m in MUTATIONS if m.audit == "issue-31")


@pytest.mark.parametrize("mutation", [m for m in MUTATIONS if m.old], ids=lambda m: m.name)
def test_each_patch_applies_once_and_its_tests_exist(mutation):
    text = (REPO / mutation.file).read_text()
    assert text.count(mutation.old) == 1, (f"{mutation.name}: the snippet occurs {text.count(mutation.old)} times in "
                                           f"{mutation.file}; update it in tools/mutation_check.py")
    assert mutation.new != mutation.old
    ast.parse(text.replace(mutation.old, mutation.new))   # the mutant still compiles: a catch must be a test's
    for test in mutation.tests:
        assert (REPO / test.split("::")[0]).is_file(), f"{mutation.name}: {test} does not exist"


# ---- tools/mutation_run.py (the cosmic-ray campaign): its table and its filters, without cosmic-ray ----

run_spec = importlib.util.spec_from_file_location("mutation_run", REPO / "tools" / "mutation_run.py")
mutation_run = importlib.util.module_from_spec(run_spec)
sys.modules["mutation_run"] = mutation_run
run_spec.loader.exec_module(mutation_run)


def test_every_module_of_the_mutated_packages_has_tests_that_exist():
    """A new module in comm/, sync/, reliability/, training/ or costmodel/ needs its line in TESTS."""
    modules = {str(p.relative_to(REPO)) for prefix in set(mutation_run.PACKAGES.values())
               for p in (REPO / prefix).rglob("*.py")}
    modules -= {"src/ddtrain/reliability/__init__.py", "src/ddtrain/training/__init__.py"}   # empty files
    assert sorted(modules - set(mutation_run.TESTS)) == [], "add these to TESTS in tools/mutation_run.py"
    for source, tests in mutation_run.TESTS.items():
        assert (REPO / source).is_file(), source
        assert tests and all((REPO / t.split("::")[0]).is_file() for t in tests), (source, tests)


def test_one_slip_per_operator_site():
    kept = mutation_run.kept
    assert kept("core/ReplaceBinaryOperator_Add_Sub") and not kept("core/ReplaceBinaryOperator_Add_LShift")
    assert kept("core/ReplaceComparisonOperator_Lt_LtE") and not kept("core/ReplaceComparisonOperator_Lt_Gt")
    assert kept("core/NumberReplacer") and kept("core/ZeroIterationForLoop") and kept("core/ExceptionReplacer")


def test_mutants_in_annotations_and_signature_markers_are_skipped_the_rest_run():
    source = ("from __future__ import annotations\n"
              "def f(a: int | None, *, b=1) -> float | None:\n"
              "    return a * b\n")
    lines, spans = mutation_run.file_filters(source)

    def why(operator, start, end):
        return mutation_run.skip_reason({"operator_name": operator, "start_pos": start, "end_pos": end}, lines, spans)
    assert "annotation" in why("core/ReplaceBinaryOperator_BitOr_BitAnd", (2, 13), (2, 14))     # int | None
    assert "annotation" in why("core/ReplaceBinaryOperator_BitOr_BitAnd", (2, 38), (2, 39))     # -> float | None
    assert "keyword-only marker" in why("core/ReplaceBinaryOperator_Mul_Div", (2, 21), (2, 22))
    assert why("core/ReplaceBinaryOperator_Mul_Div", (3, 13), (3, 14)) is None                   # a * b: runs
    assert why("core/NumberReplacer", (2, 26), (2, 27)) is None                                  # b=1: runs
    assert mutation_run.file_filters(source.replace("from __future__ import annotations\n", "\n"))[1] == []
