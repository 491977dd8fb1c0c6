"""Starting the local Ray cluster on a saturated machine: Ray gives its node a fixed 30 s to come
up; ``init_ray`` starts it again when that ran out (Ray's own start-up timeout cannot be provoked
on demand, so ``ray.init`` is replaced by one that fails the way Ray does, then succeeds)."""

from __future__ import annotations

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
