"""The fast lane (``pytest -m "not slow"``): tests are marked ``slow`` by the fixtures they use.

The root conftest.py marks every test whose fixture closure holds ``slow_fixture``, which the
fixtures that start Ray, a subprocess run, a browser or an agent CLI request. These tests collect
real test files of the suite and check which of their tests the marker selects.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


REPORTER = """
def pytest_collection_finish(session):
    for item in session.items:
        print("COLLECTED", "slow" if item.get_closest_marker("slow") else "fast", item.nodeid)
"""


def collect(tmp: Path, *paths: str) -> dict[str, set[str]]:
    """The node ids of ``paths`` by lane, as a contributor's pytest collects them (in a child
    pytest, with a small plugin that prints each item's marker)."""
    (tmp / "lane_reporter.py").write_text(REPORTER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "lane_reporter",
                          *paths], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lanes: dict[str, set[str]] = {"slow": set(), "fast": set()}
    for line in out.stdout.splitlines():
        if line.startswith("COLLECTED "):
            _, lane, nodeid = line.split(" ", 2)
            lanes[lane].add(nodeid)
    return lanes


def fixture_users(path: str, fixture: str) -> set[str]:
    """Names of the test functions in ``path`` that take ``fixture`` as an argument."""
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    return {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
            and fixture in {a.arg for a in f.args.args}}


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> dict[str, set[str]]:
    """The slow and the fast tests of a few files: one whose tests take the Ray cluster, one that
    reaches it only through another fixture (``recorded_run``), and one with neither."""
    return collect(tmp_path_factory.mktemp("lanes"), "tests/test_e2e_torch.py", "tests/records/test_records_run.py",
                   "tests/test_config.py")


def names(ids: set[str], path: str) -> set[str]:
    return {i.split("::", 1)[1].split("[", 1)[0] for i in ids if i.startswith(path + "::")}


def test_a_test_that_takes_the_ray_cluster_is_slow(split):
    ray_tests = fixture_users("tests/test_e2e_torch.py", "ray_cluster")
    assert ray_tests, "tests/test_e2e_torch.py has no test taking ray_cluster any more: pick another file"
    assert ray_tests <= names(split["slow"], "tests/test_e2e_torch.py")
    assert not ray_tests & names(split["fast"], "tests/test_e2e_torch.py")


def test_a_fixture_that_uses_the_ray_cluster_makes_its_tests_slow(split):
    recorded = fixture_users("tests/records/test_records_run.py", "recorded_run")
    assert recorded and recorded <= names(split["slow"], "tests/records/test_records_run.py")


def test_tests_without_such_fixtures_stay_in_the_fast_lane(split):
    tree = ast.parse((REPO / "tests/test_config.py").read_text(encoding="utf-8"))
    every = {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
    assert every and names(split["fast"], "tests/test_config.py") == every
    assert not names(split["slow"], "tests/test_config.py")


def test_this_test_is_not_slow(request):
    assert request.node.get_closest_marker("slow") is None


def test_a_test_that_requests_slow_fixture_is_marked(request, slow_fixture):
    """What a fixture that starts Ray does (requesting ``slow_fixture``), done by a test: the marker
    is on the test itself, so `-m "not slow"` leaves it out."""
    assert request.node.get_closest_marker("slow") is not None
