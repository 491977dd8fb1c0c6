"""``code_tests``: grade a function-level coding answer by running tests on it in the sandbox.

The response's code (the last fenced code block, after any ``</think>``) is written to
``solution.py`` in the trajectory's sandbox and run against the row's tests, in the two shapes
public code datasets use:

* a list of test statements (MBPP's ``test_list``: ``["assert add(1, 2) == 3", ...]``): each runs
  on its own, so a score can count them;
* a test program (HumanEval's ``test``, usually a ``check(candidate)`` function): it runs after the
  solution, then ``check(<entry_point>)`` when the row names an ``entry_point``; it passes when it
  raises nothing.

A runner script executes the solution and each test in one Python process started in the sandbox
(so the sandbox's limits and isolation apply) and reports per test; an exception, a ``sys.exit``
or a timeout counts as a failure. Score: 1.0 when every test passes, else 0; with
``partial_credit`` the share that passed.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from loongsage_hookspecs import Reward, Trajectory

from .swe_reward import write_in_sandbox

SOLUTION_FILE = "solution.py"
RUNNER_FILE = "run_code_tests.py"
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)

RUNNER = '''\
import json, os, sys, traceback
os.remove(__file__)  # the code under test cannot read the marker from here
MARK = {mark!r}
TESTS = {tests!r}
SCRIPT = {script!r}
ENTRY = {entry!r}
SETUP = {setup!r}
results = []
env = {{"__name__": "solution"}}
try:
    exec(compile(open({solution!r}).read(), {solution!r}, "exec"), env)
    exec(compile(SETUP, "<setup>", "exec"), env)
    loaded = None
except BaseException as exc:
    loaded = "the solution does not run: " + "".join(traceback.format_exception_only(type(exc), exc)).strip()
def one(source, name):
    if loaded:
        return {{"test": name, "passed": False, "error": loaded}}
    try:
        exec(compile(source, name, "exec"), dict(env))
        return {{"test": name, "passed": True}}
    except BaseException as exc:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip() or type(exc).__name__
        return {{"test": name, "passed": False, "error": text[-500:]}}
if SCRIPT is not None:
    results.append(one(SCRIPT + ("\\ncheck(" + ENTRY + ")\\n" if ENTRY else ""), "<test program>"))
for i, test in enumerate(TESTS):
    results.append(one(test, "test %d: %s" % (i, test[:200])))
sys.stdout.write("\\n" + MARK + json.dumps(results) + "\\n")
'''


def extract_code(text: str) -> str:
    """The last fenced code block of ``text`` (after the last ``</think>``); the text itself if none."""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    blocks = _FENCE.findall(text)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python or blocks:
        return (python or [code for _, code in blocks])[-1]
    return text.strip()


def _tests_of(meta: dict[str, Any], tests_key: str) -> tuple[list[str], str | None]:
    value = meta.get(tests_key)
    if value is None:
        raise ValueError(f"code_tests: the row has no {tests_key!r} field (set reward_args.code_tests.tests_key)")
    if isinstance(value, str):
        return [], value
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return list(value), None
    raise ValueError(f"code_tests: row field {tests_key!r} must be a test program (string) or a non-empty list "
                     f"of test statements, got {type(value).__name__}")


def code_tests(trajectory: Trajectory, *, sandbox: Any = None, tests_key: str = "tests",
               entry_point_key: str = "entry_point", setup_key: str = "test_setup_code", timeout_s: float = 30.0,
               partial_credit: bool = False, python: str = "python3", score: float = 1.0) -> Reward:
    """Run the row's tests on the response's code in the sandbox; ``score`` when they all pass.

    Args:
        tests_key: the row field with the tests (a list of statements, or a test program).
        entry_point_key: the row field naming the function a test program's ``check`` receives.
        setup_key: the row field with code run after the solution, before the tests (imports).
        timeout_s: time limit of the whole test run (a timeout fails every test).
        partial_credit: score the share of passing tests instead of all-or-nothing.
        python: the interpreter inside the sandbox.
        score: the reward when every test passes.

    Why it scored what it did goes to ``trajectory.metadata["code_tests"]``.
    """
    if sandbox is None:
        raise ValueError("code_tests needs the trajectory's sandbox: set the data source's 'sandbox' (e.g. 'local')")
    meta = trajectory.metadata
    tests, script = _tests_of(meta, tests_key)
    entry = meta.get(entry_point_key) if script is not None else None
    setup = str(meta.get(setup_key) or "")
    code = extract_code(trajectory.response_text or "")
    record: dict[str, Any] = {"code_chars": len(code)}
    trajectory.metadata["code_tests"] = record
    if not code:
        record.update(passed=0, total=len(tests) or 1, reason="no code in the response")
        return Reward(score=0.0, details={"passed": 0.0, "parsed": 0.0}, reason="no code in the response")
    mark = f"@@code_tests:{secrets.token_hex(8)}@@"
    runner = RUNNER.format(mark=mark, tests=tests, script=script, entry=entry, setup=setup, solution=SOLUTION_FILE)
    for path, content in ((SOLUTION_FILE, code), (RUNNER_FILE, runner)):
        # ``timeout_s`` bounds the tests; the writes get at least swe_reward.WRITE_TIMEOUT_S
        problem = write_in_sandbox(sandbox, path, content, timeout_s)
        if problem:
            raise RuntimeError(f"code_tests: {problem}")
    res = sandbox.run(f"{python} {RUNNER_FILE}", timeout_s=timeout_s)
    total = len(tests) + (script is not None)
    results: list[dict[str, Any]] = []
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(mark):
            results = json.loads(line[len(mark):])
            break
    passed = sum(bool(r.get("passed")) for r in results)
    if res.timed_out:
        reason, passed = f"the tests timed out after {timeout_s:g}s", 0
    elif not results:
        reason = f"the test runner reported nothing (exit code {res.exit_code}): {res.stderr[-300:]}"
    elif passed == total:
        reason = f"all {total} tests pass"
    else:
        first = next(r for r in results if not r.get("passed"))
        reason = f"{passed}/{total} tests pass; {first['test']}: {first.get('error', 'failed')}"
    all_pass = passed == total and not res.timed_out
    record.update(passed=passed, total=total, reason=reason, exit_code=res.exit_code, timed_out=res.timed_out,
                  failures=[r for r in results if not r.get("passed")][:5])
    value = score * passed / total if partial_credit else (score if all_pass else 0.0)
    return Reward(score=value, details={"passed": passed / total, "parsed": 1.0, "timed_out": float(res.timed_out)},
                  reason=reason)
