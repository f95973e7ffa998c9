"""Code reward (ALGORITHMS.md §10, ``CodeSandboxRewardWorker``): run the response's program against the row's tests
in the sandbox (:mod:`stages.rewards.sandbox`); 1 if every test passes, else 0 (one 0/1 scale, [Q-17] fixed).

``ground_truth`` holds the tests, as a JSON string, a list, or ``{"tests": [...]}``; each test is one of

* ``{"type": "stdin_stdout", "input": "1 2\\n", "output": "3\\n"}``: the program runs as ``__main__`` with that
  stdin; its stdout must equal ``output`` up to trailing whitespace on each line and trailing blank lines;
* ``{"type": "assert", "code": "assert add(1, 2) == 3"}``: the program is executed (``__name__ != "__main__"``),
  then the assert code in the same namespace;
* ``{"type": "pytest", "code": "def test_add():\\n    assert add(1, 2) == 3"}``: as ``assert``, then every
  ``test_*`` function the code defines is called (pytest-style, without pytest).

All assert/pytest tests of a row run in one sandbox run; each stdin/stdout test is one run; scoring stops at the
first failure. The asserts pass only if the harness prints a per-run random token after them, so a program that
exits early with status 0 does not pass, and the tests are read before the program runs, so it cannot rewrite them.
The program shares the harness's process, so a deliberately adversarial one could still find the token by
introspection; stdin/stdout tests are compared outside the sandbox and cannot be faked that way. The program is the last fenced code block (```python) after the last
``</think>``; no block → 0. Rows with no or malformed tests, or where the sandbox itself failed → None.
"""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from stages.rewards.base import GROUND_TRUTH, RESPONSE, Rows, Score, json_ground_truth, outputs
from stages.rewards.registry import REWARD_WORKERS
from stages.rewards.sandbox import Sandbox, SandboxLimits, SandboxResult, default_sandbox
from stages.rewards.text import after_last_think, last_code_block, strip_special_tokens

STDIN_TYPES = ("stdin_stdout", "stdin", "io")
ASSERT_TYPES = ("assert", "pytest")

# Harness for assert/pytest tests. It reads the random token (stdin) and every test file before the solution runs
# (so the solution cannot rewrite the tests), runs the solution, then each test file in the same namespace, calls
# the ``test_*`` functions that file defined, and prints the token last.
ASSERT_HARNESS = """\
import os, sys
def _run():
    token = sys.stdin.readline().strip()
    sys.stdin.close()
    tests = [(n, open(n).read()) for n in sorted(os.listdir(".")) if n.startswith("test_case_")]
    namespace = {"__name__": "solution"}
    exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
    for name, code in tests:
        before = dict(namespace)
        exec(compile(code, name, "exec"), namespace)
        for key, value in sorted(namespace.items()):
            if key.startswith("test_") and callable(value) and before.get(key) is not value:
                value()
    sys.stdout.flush()
    sys.stdout.write("\\n" + token + "\\n")
_run()
"""


class BadTests(ValueError):
    """The row's tests are missing or malformed (the row cannot be scored)."""


@dataclass(frozen=True)
class CodeTest:
    type: str
    input: str = ""
    output: str = ""
    code: str = ""


def parse_tests(ground_truth: Any) -> list[CodeTest]:
    """``ground_truth`` (JSON string, list or ``{"tests": [...]}``) → tests; :class:`BadTests` if malformed."""
    spec = json_ground_truth(ground_truth, "tests are", BadTests)
    if isinstance(spec, dict):
        spec = spec.get("tests")
    if not isinstance(spec, list) or not spec:
        raise BadTests("expected a non-empty list of tests (or {'tests': [...]})")
    tests = []
    for i, item in enumerate(spec):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind in STDIN_TYPES and isinstance(item.get("output"), str):
            tests.append(CodeTest("stdin_stdout", str(item.get("input", "")), item["output"]))
        elif kind in ASSERT_TYPES and isinstance(item.get("code"), str) and item["code"].strip():
            tests.append(CodeTest(kind, code=item["code"]))
        else:
            raise BadTests(f"test {i} is not a stdin_stdout (input, output), assert (code) or pytest (code) test")
    return tests


def same_output(actual: str, expected: str) -> bool:
    """Outputs equal up to trailing whitespace per line and trailing blank lines."""
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.replace("\r\n", "\n").rstrip().split("\n")]
    return lines(actual) == lines(expected)


@REWARD_WORKERS.register("code_sandbox")
class CodeSandboxWorker:
    """Columns: ``response``, ``ground_truth`` (the tests). Kwargs: sandbox limits (``cpu_seconds``,
    ``wall_seconds``, ``memory_mb``, ...), ``concurrency`` (sandbox runs at once), ``require_fence`` (False: use
    the whole answer as code when it has no fenced block)."""

    columns = (RESPONSE, GROUND_TRUTH)

    def __init__(self, concurrency: int = 2, require_fence: bool = True, sandbox: Sandbox | None = None,
                 **limits: Any) -> None:
        self.concurrency = max(1, int(concurrency))
        self.require_fence = require_fence
        self.limits = SandboxLimits(**limits)
        self.sandbox = sandbox or default_sandbox()

    def score_batch(self, rows: Rows) -> dict[str, list[Score]]:
        pairs = list(zip(rows[RESPONSE], rows[GROUND_TRUTH]))
        if self.concurrency == 1 or len(pairs) <= 1:
            scores = [self.score(str(r), g) for r, g in pairs]
        else:
            with ThreadPoolExecutor(self.concurrency) as pool:
                scores = list(pool.map(lambda pair: self.score(str(pair[0]), pair[1]), pairs))
        return outputs(scores)

    def extract_program(self, response: str) -> str | None:
        answer = after_last_think(strip_special_tokens(response))
        block = last_code_block(answer)
        if block is None and not self.require_fence and answer.strip():
            return answer
        return block

    def score(self, response: str, ground_truth: Any) -> Score:
        try:
            tests = parse_tests(ground_truth)
        except BadTests:
            return None
        program = self.extract_program(response)
        if program is None:
            return 0.0
        assert_tests = [t for t in tests if t.type in ASSERT_TYPES]
        if assert_tests:
            passed = self._run_asserts(program, assert_tests)
            if passed is not True:
                return passed
        for test in tests:
            if test.type == "stdin_stdout":
                result = self.sandbox.run_python(program, test.input, limits=self.limits)
                if result.status == "sandbox_error":
                    return None
                if not (result.ok and same_output(result.stdout, test.output)):
                    return 0.0
        return 1.0

    def _run_asserts(self, program: str, tests: list[CodeTest]) -> bool | Score:
        token = secrets.token_hex(16)
        files = {"solution.py": program}
        files.update({f"test_case_{i:04d}.py": t.code for i, t in enumerate(tests)})
        result: SandboxResult = self.sandbox.run_python(ASSERT_HARNESS, token + "\n", files=files,
                                                        limits=self.limits)
        if result.status == "sandbox_error":
            return None
        lines = result.stdout.rstrip().split("\n")
        return True if result.ok and lines[-1].strip() == token else 0.0
