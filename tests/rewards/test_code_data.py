"""The shipped code tasks (data/rlvr/code.jsonl): every reference solution passes its tests in the sandbox and
every wrong solution fails, through the code worker and the router."""

from __future__ import annotations

import json

import pytest

from stages.rewards.code_sandbox import BadTests, parse_tests, same_output
from stages.rewards.routing import RewardRouter
from tests.rewards.conftest import columns, load_rows


def fenced(code: str) -> str:
    return "<think>plan</think>\n```python\n" + code + "```"


def test_shipped_tasks_are_well_formed():
    rows = load_rows("code")
    assert len(rows) >= 20 and len({r["id"] for r in rows}) == len(rows)
    kinds = {t.type for r in rows for t in parse_tests(r["ground_truth"])}
    assert kinds == {"stdin_stdout", "assert", "pytest"}


def test_reference_solutions_pass_and_wrong_ones_fail(namespace_sandbox):
    rows = load_rows("code")
    router = RewardRouter({"code": {"worker": "code_sandbox", "kwargs": {"concurrency": 2}}})
    good = router.score(columns(rows, response=[fenced(r["reference_solution"]) for r in rows]))
    bad = router.score(columns(rows, response=[fenced(r["wrong_solution"]) for r in rows]))
    assert good.score_list() == [1.0] * len(rows), [r["id"] for r, s in zip(rows, good.score_list()) if s != 1.0]
    assert bad.score_list() == [0.0] * len(rows), [r["id"] for r, s in zip(rows, bad.score_list()) if s != 0.0]


@pytest.mark.parametrize("actual, expected, same", [
    ("3\n", "3", True), ("3  \n\n", "3\n", True), ("1\r\n2\r\n", "1\n2\n", True), ("3 \n4", "3\n4\n", True),
    (" 3\n", "3\n", False), ("3\n\n4\n", "3\n4\n", False), ("", "0\n", False),
])
def test_output_comparison(actual, expected, same):
    assert same_output(actual, expected) is same


@pytest.mark.parametrize("spec", ["", "{}", json.dumps({"tests": []}), json.dumps([{"type": "assert", "code": " "}]),
                                  json.dumps([{"type": "stdin_stdout", "input": "1"}]), json.dumps(["x"])])
def test_malformed_test_specs(spec):
    with pytest.raises(BadTests):
        parse_tests(spec)
