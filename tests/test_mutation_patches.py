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
