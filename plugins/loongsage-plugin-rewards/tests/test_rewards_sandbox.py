"""``swe_tests`` and ``code_tests``: rewards that run tests in the trajectory's sandbox.

The sandbox is the real ``local`` provider (found by name through the plugin host, as a job
gets it), prepared from a shipped code-repair task's row; the rewards run commands in it with
``sandbox.run``. The test-log parsers read real ``unittest -v`` and ``pytest`` output.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from loongsage_plugin_rewards.code_reward import code_tests, extract_code
from loongsage_plugin_rewards.log_parsers import parse_pytest, parse_test_log, parse_unittest
from loongsage_plugin_rewards.swe_reward import swe_tests

from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import BuildContext, Trajectory

REPO = Path(__file__).resolve().parents[3]
SWE = REPO / "configs" / "recipes" / "swe"
ROWS = {json.loads(line)["instance_id"]: json.loads(line) for line in (SWE / "tasks.jsonl").read_text().splitlines()}
PAGER = ROWS["loongsage-mini__pager-1"]


def make_traj(response: str, metadata: dict[str, Any]) -> Trajectory:
    return Trajectory(id="t0", prompt_id="p0", group_id="g0", response_text=response, metadata=metadata)

UNITTEST_MODULE = '''
import unittest

class TestThings(unittest.TestCase):
    def test_ok(self):
        pass

    def test_prints(self):
        print("noise from the test")

    def test_doc(self):
        """A docstring line that looks ok"""

    def test_fail(self):
        self.assertEqual(1, 2)

    def test_error(self):
        raise KeyError("x")

    @unittest.skip("not today")
    def test_skip(self):
        pass

    @unittest.expectedFailure
    def test_xfail(self):
        self.assertEqual(1, 2)
'''


def test_parse_unittest_reads_real_verbose_output(tmp_path):
    (tmp_path / "test_things.py").write_text(UNITTEST_MODULE)
    proc = subprocess.run([sys.executable, "-m", "unittest", "-v"], cwd=tmp_path, capture_output=True, text=True)
    got = parse_unittest(proc.stdout + proc.stderr)
    base = "test_things.TestThings."
    assert got == {base + "test_ok": "passed", base + "test_prints": "passed", base + "test_doc": "passed",
                   base + "test_fail": "failed", base + "test_error": "error", base + "test_skip": "skipped",
                   base + "test_xfail": "xfail"}


def test_parse_unittest_reads_the_python_310_form():
    log = ("test_a (pkg.test_m.TestX) ... ok\ntest_b (pkg.test_m.TestX) ... FAIL\n\n"
           "======\nFAIL: test_b (pkg.test_m.TestX)\n")
    assert parse_unittest(log) == {"pkg.test_m.TestX.test_a": "passed", "pkg.test_m.TestX.test_b": "failed"}


def test_parse_pytest_reads_real_output(tmp_path):
    (tmp_path / "test_p.py").write_text("import pytest\n\ndef test_a():\n    pass\n\n"
                                        "@pytest.mark.parametrize('x', [1, 2])\ndef test_b(x):\n    assert x == 1\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_p.py"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert parse_pytest(proc.stdout) == {"test_p.py::test_a": "passed", "test_p.py::test_b[1]": "passed",
                                         "test_p.py::test_b[2]": "failed"}
    assert parse_test_log(proc.stdout) == parse_pytest(proc.stdout)
    with pytest.raises(ValueError, match="parser must be one of"):
        parse_test_log("", "nose")


@pytest.fixture
def sandbox_for(slow_fixture) -> Iterator[Any]:
    """``sandbox_for(row)``: a ``local`` sandbox prepared from ``row``, destroyed after the test."""
    provider = PluginHost.create().get("sandbox", "local").factory(BuildContext(), base_dir=str(SWE),
                                                                   default_timeout_s=60)
    made = []

    def make(row: dict[str, Any]) -> Any:
        box = asyncio.run(provider.create(f"t{len(made)}", {"prompt": "p", "metadata": row}))
        made.append(box)
        return box

    yield make
    for box in made:
        asyncio.run(provider.destroy(box))
    asyncio.run(provider.close())


def _apply(box: Any, patch: str) -> None:
    res = box.run(f"cat > fix.patch <<'EOF'\n{patch}EOF\ngit apply fix.patch && rm fix.patch")
    assert res.exit_code == 0, res.stderr


def test_swe_tests_scores_the_buggy_repository_0_and_the_fixed_one_1(sandbox_for):
    box = sandbox_for(PAGER)
    traj = make_traj("", metadata=dict(PAGER))
    r0 = swe_tests(traj, sandbox=box)
    assert r0.score == 0.0 and r0.details["resolved"] == 0.0
    assert r0.details["f2p_passed"] == 0.0 and r0.details["p2p_passed"] == 1.0
    why = traj.metadata["swe_tests"]
    assert why["failed"] == PAGER["FAIL_TO_PASS"] and why["missing"] == [] and "FAIL_TO_PASS 0/1" in r0.reason
    _apply(box, PAGER["patch"])
    traj = make_traj("", metadata=dict(PAGER))
    r1 = swe_tests(traj, sandbox=box)
    assert r1.score == 1.0 and r1.details["resolved"] == 1.0, r1.reason
    assert traj.metadata["swe_tests"]["resolved"] is True
    assert set(traj.metadata["swe_tests"]["outcomes"].values()) == {"passed"}


def test_swe_tests_puts_the_tests_back_before_running_them(sandbox_for):
    box = sandbox_for(PAGER)
    # an agent that "fixes" the bug by rewriting the regression test and breaking a passing one
    box.run("mkdir -p tests && printf 'import unittest\\nclass TestIssue(unittest.TestCase):\\n"
            "    def test_full_pages(self):\\n        pass\\n' > tests/test_issue.py && rm tests/test_core.py")
    r = swe_tests(make_traj("", metadata=dict(PAGER)), sandbox=box)
    assert r.score == 0.0 and r.details["p2p_passed"] == 1.0 and r.details["f2p_passed"] == 0.0


def test_swe_tests_partial_credit_missing_tests_and_timeouts(sandbox_for):
    box = sandbox_for(PAGER)
    traj = make_traj("", metadata={**PAGER, "PASS_TO_PASS": json.dumps(PAGER["PASS_TO_PASS"] + ["tests.nope.T.t"])})
    r = swe_tests(traj, sandbox=box, partial_credit=True)
    assert r.score == pytest.approx(2 / 4)  # the two real PASS_TO_PASS tests out of four listed
    assert traj.metadata["swe_tests"]["missing"] == ["tests.nope.T.t"] and "not in the output" in r.reason
    traj = make_traj("", metadata=dict(PAGER))
    r = swe_tests(traj, sandbox=box, test_cmd="sleep 30", timeout_s=1)
    assert r.score == 0.0 and r.details["timed_out"] == 1.0 and "timed out" in r.reason


def test_swe_tests_refuses_rows_it_cannot_grade(sandbox_for):
    with pytest.raises(ValueError, match="needs the trajectory's sandbox"):
        swe_tests(make_traj("", metadata=dict(PAGER)))
    box = sandbox_for(PAGER)
    with pytest.raises(ValueError, match="no 'test_cmd'"):
        swe_tests(make_traj("", metadata={**PAGER, "test_cmd": ""}), sandbox=box)
    with pytest.raises(ValueError, match="'FAIL_TO_PASS' is a string but not a JSON list"):
        swe_tests(make_traj("", metadata={**PAGER, "FAIL_TO_PASS": "tests.a"}), sandbox=box)


def test_a_task_of_each_bug_kind_scores_0_as_given_and_1_with_its_reference_patch(sandbox_for):
    """Tasks through the real sandbox and the reward, one of each kind of bug (tests/test_swe_tasks.py
    checks every task without either; all of them here would add a minute to the suite)."""
    one_per_kind = {row["bug"]: row for row in reversed(list(ROWS.values()))}
    assert len(one_per_kind) >= 8
    for row in one_per_kind.values():
        box = sandbox_for(row)
        assert swe_tests(make_traj("", metadata=dict(row)), sandbox=box).score == 0.0, row["instance_id"]
        _apply(box, row["patch"])
        r = swe_tests(make_traj("", metadata=dict(row)), sandbox=box)
        assert r.score == 1.0, f"{row['instance_id']}: {r.reason}"


ADD_ROW = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}
CHECK_ROW = {"tests": "def check(candidate):\n    assert candidate('ab') == 'ba'\n    assert candidate('') == ''\n",
             "entry_point": "rev"}


def _answer(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```\nDone."


def test_code_tests_assert_lists(sandbox_for):
    box = sandbox_for({})
    traj = make_traj(_answer("def add(a, b):\n    return a + b"), metadata=dict(ADD_ROW))
    r = code_tests(traj, sandbox=box)
    assert r.score == 1.0 and traj.metadata["code_tests"]["passed"] == 3 and r.reason == "all 3 tests pass"
    traj = make_traj(_answer("def add(a, b):\n    return a - b if a == b else a + b"), metadata=dict(ADD_ROW))
    r = code_tests(traj, sandbox=box)
    assert r.score == 0.0 and r.details["passed"] == pytest.approx(2 / 3)
    assert "test 2: assert add(2, 2) == 4" in r.reason and "AssertionError" in r.reason
    assert code_tests(traj, sandbox=box, partial_credit=True).score == pytest.approx(2 / 3)


def test_code_tests_test_programs_and_bad_solutions(sandbox_for):
    box = sandbox_for({})
    good = make_traj(_answer("def rev(s):\n    return s[::-1]"), metadata=dict(CHECK_ROW))
    assert code_tests(good, sandbox=box).score == 1.0
    wrong = make_traj(_answer("def rev(s):\n    return s"), metadata=dict(CHECK_ROW))
    assert code_tests(wrong, sandbox=box).score == 0.0
    # leaving early does not pass the tests
    quitter = make_traj(_answer("import sys\nsys.exit(0)"), metadata=dict(ADD_ROW))
    r = code_tests(quitter, sandbox=box)
    assert r.score == 0.0 and "does not run" in r.reason
    forever = make_traj(_answer("while True:\n    pass"), metadata=dict(ADD_ROW))
    r = code_tests(forever, sandbox=box, timeout_s=1)
    assert r.score == 0.0 and r.details["timed_out"] == 1.0
    empty = make_traj("I don't know.", metadata=dict(ADD_ROW))
    r = code_tests(empty, sandbox=box)
    assert r.score == 0.0 and "does not run" in r.reason  # the prose itself is run as code, and fails
    with pytest.raises(ValueError, match="no 'tests' field"):
        code_tests(make_traj(_answer("x = 1"), metadata={}), sandbox=box)


def test_extract_code_takes_the_last_python_block_after_thinking():
    text = "<think>```python\nbad()\n```</think>```text\nlog\n```\n```python\ngood()\n```"
    assert extract_code(text) == "good()\n"
    assert extract_code("```\nplain()\n```") == "plain()\n"
    assert extract_code("  x = 1  ") == "x = 1"
