"""Actor death under agents: an engine killed while AgentFlow trajectories generate on it is
replaced, the router sends the lost turns to a live engine, and no trajectory fails."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from loongsage_core.config import load_job
from loongsage_core.controller.run import SyncLoop
from loongsage_core.controller.runtime import Run
from loongsage_core.resolve import resolve_job


def kill(actor) -> None:
    """``ray.kill`` and wait until the actor is dead (as tests/test_actor_death.py does)."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + 120
    while True:
        try:
            ray.get(actor.ready.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed actor still answers"
        time.sleep(0.2)

TOOL_AGENT = '''agent = "tool_agent"
sandbox = "local"
agent_args = { max_turns = 2, shell_tool = false }
reward = ["exact_match"]'''


def test_engine_killed_under_agent_turns_is_replaced_and_no_trajectory_fails(ray_cluster, tiny_job, tmp_path):
    path = tiny_job.write(tmp_path)
    path.write_text(path.read_text().replace('reward = ["exact_match"]', TOOL_AGENT))
    job = load_job(path, ["placement.colocate=false", "rollout.num_engines=2", "rollout.weight_transport=shm",
                          "rollout.max_new_tokens=24", "train.total_steps=3"])
    out = tmp_path / "run"
    controller = Run(resolve_job(job), out)
    killed: list[str] = []
    try:
        controller.start()
        controller.rollout.start_router()  # started now to watch its engine calls
        pool = controller.rollout.router.engines
        engine_call = pool.generate
        victim = controller.actors.engine_actors[1]
        victim_url = controller.actors.engine_urls[1]

        async def generate(url, *args, **kwargs):
            # the first call to engine 1 in step 1: the engine dies while the call is in flight
            if controller.armed and not killed and url == victim_url:
                killed.append(url)
                call = asyncio.ensure_future(engine_call(url, *args, **kwargs))
                await asyncio.to_thread(kill, victim)
                return await call
            return await engine_call(url, *args, **kwargs)

        pool.generate = generate
        controller.armed = False

        class Arm:
            def log(self, step: int, metrics: dict) -> None:
                controller.armed = step == 0

            def close(self) -> None:
                pass

        controller.loggers.append(Arm())
        history = SyncLoop(controller).fit()
        stats = controller.rollout.router.stats_now()
        urls = list(controller.rollout.router.balancer.urls)
        new_url = controller.actors.engine_urls[1]
    finally:
        controller.close()
    assert killed == [victim_url]
    assert [m["step"] for m in history] == [0, 1, 2]
    assert [m["fault/engine_restarts"] for m in history] == [0.0, 1.0, 1.0]
    # the turn that met the dead engine was sent again; the router now knows the new engine only
    assert stats["engine_retries"] >= 1
    assert new_url != victim_url and victim_url not in urls and new_url in urls
    # no trajectory failed because of the death, every prompt of every step trained
    assert [m["rollout/failed_ratio"] for m in history] == [0.0, 0.0, 0.0]
    per_step = [json.loads(line) for line in (Path(out) / "trained_prompts.jsonl").read_text().splitlines()]
    assert [len(e["prompt_ids"]) for e in per_step] == [2, 2, 2] and not any("skipped" in e for e in per_step)
    assert [m["perf/weight_version"] for m in history] == [1.0, 2.0, 3.0]
    # token-exact: the recorded log-probs are the trainer's (no half-recorded or foreign turn)
    assert all(m["train/is_approx_k3_kl"] < 1e-6 for m in history)
