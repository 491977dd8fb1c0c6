"""Per-test outcomes from a test runner's output: ``unittest -v`` and ``pytest -rA`` / ``-v``.

SWE-bench-style grading names tests by id (``FAIL_TO_PASS`` / ``PASS_TO_PASS``) and reads their
outcome from the log of one test command, the way the SWE-bench harness's log parsers do. Ids:

* unittest: ``package.module.Class.method`` (what ``python -m unittest -v`` prints in parentheses
  on Python 3.11+; the 3.10 form ``method (package.module.Class)`` is read the same way);
* pytest: the node id, ``tests/test_x.py::Class::test_y`` (parametrised ids included).

Outcomes: ``passed``, ``failed``, ``error``, ``skipped``, ``xfail`` (an expected failure, counts as
passed as SWE-bench counts it), ``xpass`` (an unexpected success, counts as failed).
"""

from __future__ import annotations

import re

PASSING = frozenset({"passed", "xfail"})
PARSERS = ("auto", "unittest", "pytest")

_UNITTEST_START = re.compile(r"^(?P<method>[A-Za-z_]\w*) \((?P<where>[A-Za-z_][\w.]*)\)")
_UNITTEST_STATUS = {"ok": "passed", "FAIL": "failed", "ERROR": "error", "skipped": "skipped",
                    "expected failure": "xfail", "unexpected success": "xpass"}
_UNITTEST_TAIL = re.compile(r"(?:^|\.\.\. ?)(ok|FAIL|ERROR|skipped\b.*|expected failure|unexpected success)\s*$")
_UNITTEST_REPORT = re.compile(r"^(FAIL|ERROR): (?P<method>[A-Za-z_]\w*) \((?P<where>[A-Za-z_][\w.]*)\)", re.M)

_PYTEST_WORDS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
                 "XFAIL": "xfail", "XPASS": "xpass"}
_PYTEST_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+)", re.M)
_PYTEST_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)


def _unittest_id(method: str, where: str) -> str:
    """``where`` is ``module.Class.method`` (3.11+) or ``module.Class`` (3.10 and older)."""
    return where if where.endswith("." + method) else f"{where}.{method}"


def _status_word(text: str) -> str:
    return _UNITTEST_STATUS["skipped" if text.startswith("skipped") else text]


def parse_unittest(output: str) -> dict[str, str]:
    """Test id -> outcome from ``python -m unittest -v`` output (stderr and stdout together)."""
    results: dict[str, str] = {}
    current: str | None = None
    for line in output.splitlines():
        start = _UNITTEST_START.match(line)
        rest = line
        if start:
            current = _unittest_id(start.group("method"), start.group("where"))
            rest = line[start.end():]
        if current is None:
            continue
        tail = _UNITTEST_TAIL.search(rest)
        if tail and (start or " ... " in f" {rest}" or rest.strip() == tail.group(1)):
            results[current] = _status_word(tail.group(1))
            current = None
    # the failure reports at the end are authoritative (a test that printed may hide its status)
    for m in _UNITTEST_REPORT.finditer(output):
        results[_unittest_id(m.group("method"), m.group("where"))] = "failed" if m.group(1) == "FAIL" else "error"
    return results


def parse_pytest(output: str) -> dict[str, str]:
    """Node id -> outcome from pytest output (``-rA`` summary lines and/or ``-v`` progress lines)."""
    results: dict[str, str] = {}
    for m in _PYTEST_VERBOSE.finditer(output):
        results[m.group(1)] = _PYTEST_WORDS[m.group(2)]
    for m in _PYTEST_SUMMARY.finditer(output):  # the summary wins (a teardown error follows PASSED)
        results[m.group(2)] = _PYTEST_WORDS[m.group(1)]
    return results


def parse_test_log(output: str, parser: str = "auto") -> dict[str, str]:
    """Outcomes by test id; ``auto`` reads both formats (they cannot be confused: pytest ids have ``::``)."""
    if parser not in PARSERS:
        raise ValueError(f"test log parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    results: dict[str, str] = {}
    if parser in ("auto", "unittest"):
        results.update(parse_unittest(output))
    if parser in ("auto", "pytest"):
        results.update(parse_pytest(output))
    return results
