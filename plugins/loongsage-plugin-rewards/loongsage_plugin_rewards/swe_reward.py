"""``swe_tests``: grade a code-repair trajectory by running the task's tests in its sandbox.

The row is a SWE-bench instance (``instance_id``, ``problem_statement``, ``FAIL_TO_PASS``,
``PASS_TO_PASS``, ...) plus ``test_cmd``, the command that runs the tests in the repository. The
reward runs after the agent, in the same sandbox, before it is destroyed, so it grades exactly
the files the agent left. Before running the tests it puts the task's tests in place (the agent
may have edited or deleted them, and the regression tests may be hidden from it):

* ``test_files`` (``{path: content}``): written over whatever is there;
* ``test_patch`` (a unified diff, SWE-bench's field): applied with ``git apply`` (``patch -p1``
  where git is missing); a patch that does not apply scores 0 with that reason.

Then ``test_cmd`` runs once; its output is read per test (:mod:`.log_parsers`). Score: 1.0 when
every FAIL_TO_PASS and every PASS_TO_PASS test passed ("resolved" in SWE-bench's terms), else 0;
with ``partial_credit`` the share of the listed tests that passed. A listed test missing from the
output (not collected, its module failed to import) counts as failed.
"""

from __future__ import annotations

import base64
import json
import shlex
from typing import Any

from loongsage_hookspecs import Reward, Trajectory

from .log_parsers import PASSING, parse_test_log

OUTPUT_TAIL = 2000
PATCH_FILE = ".loongsage_test.patch"


def _test_list(meta: dict[str, Any], key: str) -> list[str]:
    """A row's FAIL_TO_PASS / PASS_TO_PASS: a list, or a JSON-encoded list as SWE-bench ships them."""
    value = meta.get(key, [])
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise ValueError(f"swe_tests: row field {key!r} is a string but not a JSON list: {value[:60]!r}") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"swe_tests: row field {key!r} must be a list of test ids, got {type(value).__name__}")
    return value


WRITE_TIMEOUT_S = 30.0
"""The least time each setup command (writing a file, applying the test patch) gets, whatever the
tests' own ``timeout_s``: a short test budget must not fail the setup on a busy machine."""


def write_commands(path: str, content: str, chunk: int = 64 * 1024) -> list[str]:
    """Shell commands that write ``content`` to ``path`` (relative to the sandbox directory): the
    first truncates, the rest append base64 chunks (each far below the 128 KiB argument limit)."""
    data = content.encode()
    quoted = shlex.quote(path)
    out = [f"mkdir -p \"$(dirname {quoted})\" && rm -f {quoted} && : > {quoted}"]
    for i in range(0, len(data), chunk):
        out.append(f"printf %s {base64.b64encode(data[i:i + chunk]).decode()} | base64 -d >> {quoted}")
    return out


def write_in_sandbox(sandbox: Any, path: str, content: str, timeout_s: float) -> str | None:
    """Write a file by commands run in the sandbox (as its user, inside its isolation: never from the
    host side, where a symlink the agent left could point anywhere). Returns why it failed, or None.
    Each command gets ``timeout_s``, at least :data:`WRITE_TIMEOUT_S`."""
    if path.startswith("/") or ".." in path.split("/"):
        raise ValueError(f"path {path!r} must be relative and inside the sandbox directory")
    timeout_s = max(timeout_s, WRITE_TIMEOUT_S)
    for command in write_commands(path, content):
        res = sandbox.run(command, timeout_s=timeout_s)
        if res.exit_code != 0:
            why = f"timed out after {timeout_s:g}s" if res.timed_out else (res.stderr or res.stdout)[-300:]
            return f"could not write {path}: {why}"
    return None


def put_tests_in_place(sandbox: Any, meta: dict[str, Any], timeout_s: float) -> str | None:
    """Write ``test_files`` / apply ``test_patch``; the reason they could not be, or None."""
    files = meta.get("test_files") or {}
    if not isinstance(files, dict):
        raise ValueError("swe_tests: row field 'test_files' must be an object {path: content}")
    for path, content in files.items():
        problem = write_in_sandbox(sandbox, str(path), str(content), timeout_s)
        if problem:
            return problem
    patch = meta.get("test_patch")
    if patch:
        problem = write_in_sandbox(sandbox, PATCH_FILE, str(patch), timeout_s)
        if problem:
            return problem
        res = sandbox.run(f"if command -v git >/dev/null; then git apply -v {PATCH_FILE}; "
                          f"else patch -p1 --forward < {PATCH_FILE}; fi; s=$?; rm -f {PATCH_FILE}; exit $s",
                          timeout_s=max(timeout_s, WRITE_TIMEOUT_S))
        if res.exit_code != 0:
            return f"test_patch does not apply: {(res.stderr or res.stdout)[-300:]}"
    return None


def swe_tests(trajectory: Trajectory, *, sandbox: Any = None, test_cmd: str | None = None,
              timeout_s: float = 300.0, parser: str = "auto", partial_credit: bool = False,
              score: float = 1.0) -> Reward:
    """Run the task's tests on the agent's edits; ``score`` when all FAIL_TO_PASS and PASS_TO_PASS pass.

    Args:
        test_cmd: the test command (default: the row's ``test_cmd``).
        timeout_s: time limit of the test command (a timeout scores 0).
        parser: how to read per-test outcomes: ``auto``, ``unittest`` or ``pytest``.
        partial_credit: score the share of listed tests that pass instead of all-or-nothing.
        score: the reward for a resolved task.

    Why it scored what it did goes to ``trajectory.metadata["swe_tests"]``: the tests that failed,
    the tests missing from the output, the exit code and the tail of the output.
    """
    meta = trajectory.metadata
    if sandbox is None:
        raise ValueError("swe_tests needs the trajectory's sandbox: set the data source's 'sandbox' (e.g. 'local')")
    command = test_cmd or meta.get("test_cmd")
    if not command:
        raise ValueError("swe_tests: the row has no 'test_cmd' and reward_args sets none")
    f2p, p2p = _test_list(meta, "FAIL_TO_PASS"), _test_list(meta, "PASS_TO_PASS")
    if not f2p and not p2p:
        raise ValueError("swe_tests: the row lists no FAIL_TO_PASS or PASS_TO_PASS tests")
    record: dict[str, Any] = {"instance_id": meta.get("instance_id"), "test_cmd": command}
    trajectory.metadata["swe_tests"] = record
    problem = put_tests_in_place(sandbox, meta, timeout_s)
    if problem:
        record.update(resolved=False, reason=problem)
        return Reward(score=0.0, details={"resolved": 0.0, "f2p_passed": 0.0, "p2p_passed": 0.0}, reason=problem)
    res = sandbox.run(command, timeout_s=timeout_s)
    outcomes = parse_test_log(res.stdout + "\n" + res.stderr, parser)
    failed = [t for t in f2p + p2p if t in outcomes and outcomes[t] not in PASSING]
    missing = [t for t in f2p + p2p if t not in outcomes]
    f2p_ok = sum(outcomes.get(t) in PASSING for t in f2p)
    p2p_ok = sum(outcomes.get(t) in PASSING for t in p2p)
    resolved = not res.timed_out and f2p_ok == len(f2p) and p2p_ok == len(p2p)
    if res.timed_out:
        reason = f"the tests timed out after {timeout_s:g}s"
    elif resolved:
        reason = f"resolved: {len(f2p)} FAIL_TO_PASS and {len(p2p)} PASS_TO_PASS tests pass"
    else:
        parts = [f"FAIL_TO_PASS {f2p_ok}/{len(f2p)}", f"PASS_TO_PASS {p2p_ok}/{len(p2p)}"]
        if failed:
            parts.append("failed: " + ", ".join(failed[:5]) + (" ..." if len(failed) > 5 else ""))
        if missing:
            parts.append("not in the output: " + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
        reason = "; ".join(parts)
    total = len(f2p) + len(p2p)
    value = (score * (f2p_ok + p2p_ok) / total if partial_credit and not res.timed_out
             else score if resolved else 0.0)
    record.update(resolved=resolved, reason=reason, failed=failed, missing=missing, exit_code=res.exit_code,
                  timed_out=res.timed_out, outcomes={t: outcomes.get(t, "missing") for t in f2p + p2p},
                  output_tail=(res.stdout + res.stderr)[-OUTPUT_TAIL:])
    details = {"resolved": float(resolved), "f2p_passed": f2p_ok / len(f2p) if f2p else 1.0,
               "p2p_passed": p2p_ok / len(p2p) if p2p else 1.0, "timed_out": float(res.timed_out)}
    return Reward(score=value, details=details, reason=reason)
