"""Starting the local Ray cluster.

On a saturated machine: Ray gives its node a fixed 30 s to come up; ``init_ray`` starts it again
when that ran out (Ray's own start-up timeout cannot be provoked on demand, so ``ray.init`` is
replaced by one that fails the way Ray does, then succeeds). The workers' environment comes from
the driver, not a job ``runtime_env``, so actors take the idle workers Ray starts with the
cluster (checked on a real cluster in a child process)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loongsage_core.config import structure_job
from loongsage_core.controller import placement
from loongsage_core.controller.resource_errors import RayStartError

TIMED_OUT = ("The current node timed out during startup. This could happen because some of the raylet "
             "failed to startup or the GCS has become overloaded.")


def test_a_node_that_timed_out_during_start_up_is_started_again(monkeypatch, caplog):
    import ray

    calls: list[str] = []

    def init(**kwargs):
        calls.append("init")
        if calls.count("init") < 3:
            raise Exception(TIMED_OUT)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with caplog.at_level("WARNING", logger="loongsage"):
        placement.init_ray(structure_job({}))
    assert calls == ["init", "shutdown", "init", "shutdown", "init"]
    assert sum("did not start in time" in r.message for r in caplog.records) == 2


def test_other_start_up_errors_and_the_last_timeout_are_raised(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    attempts = []

    def timed_out(**kwargs):
        attempts.append(1)
        raise Exception(TIMED_OUT)

    monkeypatch.setattr(ray, "init", timed_out)
    with pytest.raises(Exception, match="timed out during startup"):
        placement.init_ray(structure_job({}))
    assert len(attempts) == placement.LOCAL_START_ATTEMPTS

    def refused(**kwargs):
        attempts.append(1)
        raise ValueError("object_store_memory is too small")

    attempts.clear()
    monkeypatch.setattr(ray, "init", refused)
    with pytest.raises(RayStartError, match="the local Ray cluster did not start: ValueError: .*too small"):
        placement.init_ray(structure_job({}))
    assert len(attempts) == 1


def test_a_local_cluster_passes_the_workers_environment_without_a_job_runtime_env(monkeypatch):
    """The workers of a local cluster get ``TOKENIZERS_PARALLELISM=false`` from the driver's
    environment, not from a job ``runtime_env`` (with one, no actor could take an idle worker);
    a value the user set is kept."""
    import ray

    seen: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.append(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    placement.init_ray(structure_job({}))
    assert "runtime_env" not in seen[0] and os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    placement.init_ray(structure_job({}))
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"


ACTOR_ON_AN_IDLE_WORKER = """
import json, os, subprocess, sys, time
import ray
from loongsage_core.config import structure_job
from loongsage_core.controller import placement

placement.init_ray(structure_job({"run": {"ray_num_cpus": 2, "ray_object_store_mb": 80}}))
def idle():
    return set(subprocess.run(["pgrep", "-f", "^ray::IDLE"], capture_output=True, text=True).stdout.split())
deadline = time.monotonic() + 60
while len(idle()) < 2 and time.monotonic() < deadline:  # the workers Ray starts with the cluster
    time.sleep(0.2)
time.sleep(1.0)  # registered with the raylet
before = idle()

@ray.remote(num_cpus=1)
class Probe:
    def where(self):
        return os.getpid(), os.environ.get("TOKENIZERS_PARALLELISM"), ray.get_runtime_context().runtime_env

pid, tokenizers, runtime_env = ray.get(Probe.remote().where.remote())
print(json.dumps({"idle_before": sorted(before), "actor_pid": str(pid), "tokenizers": tokenizers,
                  "runtime_env": dict(runtime_env)}))
ray.shutdown()
"""


@pytest.mark.slow
def test_an_actor_of_a_local_cluster_takes_a_worker_ray_started_ahead(tmp_path):
    """``init_ray``'s local cluster: an actor runs in one of the idle workers Ray started with the
    cluster (no new interpreter to wait for), and sees ``TOKENIZERS_PARALLELISM=false``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TOKENIZERS_PARALLELISM")}
    done = subprocess.run([sys.executable, "-c", ACTOR_ON_AN_IDLE_WORKER], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tokenizers"] == "false" and not got["runtime_env"]
    assert len(got["idle_before"]) >= 2 and got["actor_pid"] in got["idle_before"], got


def test_every_ray_cluster_of_the_repository_is_started_by_placement():
    """The controller, the test fixtures, the benchmarks and the scripts start (or join) Ray only
    through :mod:`loongsage_core.controller.placement`, so a test or a benchmark measures the
    cluster a user's run gets (loopback only, workers at the driver's priority, their environment)."""
    repo = Path(__file__).resolve().parents[2]
    tracked = subprocess.run(["git", "ls-files", "*.py"], capture_output=True, text=True, cwd=repo, check=True)
    callers = set()
    for name in tracked.stdout.split():
        path = repo / name
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "init"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "ray"):
                callers.add(path.relative_to(repo).as_posix())
    assert callers == {"loongsage_core/controller/placement.py"}, callers
