"""The shipped code-repair tasks (configs/recipes/swe): every task is a real bug with a real fix.

For each row: the repository snapshot unpacks, its FAIL_TO_PASS tests fail and its PASS_TO_PASS
tests pass on the buggy code, and all of them pass once the reference patch is applied with
``git apply``, all through the row's own ``test_cmd``. Also: the rows have the SWE-bench shape,
and the generator rewrites the shipped files byte for byte.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from loongsage_plugin_rewards.log_parsers import PASSING, parse_test_log

REPO = Path(__file__).resolve().parents[1]
SWE = REPO / "configs" / "recipes" / "swe"
ROWS = [json.loads(line) for line in (SWE / "tasks.jsonl").read_text().splitlines() if line.strip()]
FIELDS = {"instance_id", "repo", "problem_statement", "test_cmd", "FAIL_TO_PASS", "PASS_TO_PASS", "patch",
          "sandbox", "test_files"}


def test_at_least_thirty_distinct_tasks_in_swe_bench_shape():
    assert len(ROWS) >= 30
    assert len({r["instance_id"] for r in ROWS}) == len(ROWS)
    assert len({r["repo"] for r in ROWS}) == len(ROWS)
    for row in ROWS:
        assert FIELDS <= set(row), row["instance_id"]
        assert row["FAIL_TO_PASS"] and row["PASS_TO_PASS"], row["instance_id"]
        assert (SWE / row["sandbox"]["snapshot"]).is_file(), row["instance_id"]
    assert len({r["bug"] for r in ROWS}) >= 8  # many kinds of bug, not one pattern


def _checkout(row: dict, dest: Path) -> Path:
    with tarfile.open(SWE / row["sandbox"]["snapshot"]) as tar:
        tar.extractall(dest, filter="data")
    for path, content in row["test_files"].items():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_text(content)
    return dest


def _outcomes(row: dict, cwd: Path) -> dict[str, str]:
    proc = subprocess.run(row["test_cmd"], shell=True, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})
    return parse_test_log(proc.stdout + proc.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=[r["instance_id"] for r in ROWS])
def test_task_fails_before_and_passes_after_the_reference_patch(row, tmp_path):
    snapshot = _checkout({**row, "test_files": {}}, tmp_path / "snapshot")
    hidden = [p for p in row["test_files"] if not (snapshot / p).exists()]
    assert hidden, f"{row['instance_id']}: the regression test should be hidden from the agent"
    repo = _checkout(row, tmp_path / "repo")
    before = _outcomes(row, repo)
    for test in row["FAIL_TO_PASS"]:
        assert before.get(test) not in PASSING, f"{test} passes on the buggy repository"
    for test in row["PASS_TO_PASS"]:
        assert before.get(test) == "passed", f"{test}: {before.get(test)} on the buggy repository"
    (repo / "fix.patch").write_text(row["patch"])
    subprocess.run(["git", "apply", "fix.patch"], cwd=repo, check=True, capture_output=True)
    (repo / "fix.patch").unlink()
    after = _outcomes(row, repo)
    for test in row["FAIL_TO_PASS"] + row["PASS_TO_PASS"]:
        assert after.get(test) == "passed", f"{test}: {after.get(test)} with the reference patch"


@pytest.mark.slow
def test_generator_rewrites_the_shipped_files(tmp_path):
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_swe_tasks.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=600)
    assert (tmp_path / "tasks.jsonl").read_bytes() == (SWE / "tasks.jsonl").read_bytes()
    for tar in sorted((SWE / "repos").glob("*.tar.gz")):
        assert (tmp_path / "repos" / tar.name).read_bytes() == tar.read_bytes(), tar.name
    assert len(list((tmp_path / "repos").iterdir())) == len(ROWS)
    shutil.rmtree(tmp_path)
