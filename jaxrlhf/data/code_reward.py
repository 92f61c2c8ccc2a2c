"""The `code` reward: the completion's Python program run against the row's test cases.

A prompt row's `answer` holds the tests as JSON, a list of `{"input": STDIN, "output": STDOUT}`.
The program is the last ```python fenced block of the completion (else the last fenced block,
else the whole completion); each test runs it in the sandbox (`data/sandbox.py`) and passes
when it exits cleanly and its stdout equals the expected output up to surrounding whitespace.
The reward is the fraction of tests passed; a program that loops, crashes, exhausts memory,
floods its output or tries to leave the sandbox fails that test (score 0 for it).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re

from jaxrlhf.data.sandbox import Limits, RunStatus, run_python

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The program in `completion`: its last ```python block, else last fenced block, else all."""
    blocks = _FENCE.findall(completion)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else completion


def parse_tests(answer: str | None) -> list[tuple[str, str]]:
    """[(stdin, expected stdout)] from a row's `answer`.

    Raises:
      ValueError: no answer, not JSON, or not a non-empty list of {"input", "output"} strings.
    """
    if answer is None:
        raise ValueError("the code reward needs test cases in the row's answer; it has none")
    tests = json.loads(answer)
    if not isinstance(tests, list) or not tests or not all(
            isinstance(t, dict) and isinstance(t.get("input"), str)
            and isinstance(t.get("output"), str) for t in tests):
        raise ValueError('code tests must be a non-empty JSON list of {"input": str, '
                         '"output": str}')
    return [(t["input"], t["output"]) for t in tests]


@dataclasses.dataclass(frozen=True)
class TestReport:
    """passed: tests passed; statuses: how each run ended (failures by kind)."""

    passed: int
    total: int
    statuses: collections.Counter

    @property
    def failed(self) -> int:
        return self.total - self.passed

    @property
    def score(self) -> float:
        return self.passed / self.total


def run_tests(code: str, tests: list[tuple[str, str]], limits: Limits = Limits()) -> TestReport:
    """Runs `code` once per test in the sandbox; a test passes on a clean exit with the
    expected stdout (surrounding whitespace ignored)."""
    passed, statuses = 0, collections.Counter()
    for stdin, expected in tests:
        result = run_python(code, stdin, limits)
        statuses[result.status] += 1
        passed += result.status is RunStatus.OK and result.stdout.strip() == expected.strip()
    return TestReport(passed, len(tests), statuses)


def code_reward(prompt: str, completion: str, answer: str | None) -> float:
    """Fraction of the row's tests the completion's program passes (see module docstring)."""
    del prompt
    return run_tests(extract_code(completion), parse_tests(answer)).score
