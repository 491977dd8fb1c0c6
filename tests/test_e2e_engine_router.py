"""A run whose generation goes through the real sglang-router in front of two embedded engines."""

from __future__ import annotations

from pathlib import Path

import httpx

from loongsage_core.config import load_job
from loongsage_core.controller.run import SyncLoop
from loongsage_core.controller.runtime import Run
from loongsage_core.resolve import resolve_job
from loongsage_core.security import read_secret_file

REPO = Path(__file__).resolve().parent.parent

JOB = f"""
[plugins]
enable = ["torch", "sglang", "rl", "rewards", "loggers", "agents"]
[model]
path = "{REPO / 'configs' / 'quickstart' / 'model'}"
[train]
lr = 1e-3
total_steps = 2
mini_batch_size = 16
micro_batch_size = 8
[rollout]
num_engines = 2
prompts_per_step = 4
samples_per_prompt = 4
max_new_tokens = 6
engine_router = "sglang_router"
engine_router_args = {{ policy = "round_robin" }}
[placement]
colocate = false
[run]
seed = 1
checkpoint_every = 0
save_hf_at_end = false
[[data]]
name = "arithmetic"
generator = "arithmetic"
generator_args = {{ num_samples = 40, digits = 1, num_operands = 2, ops = "+-" }}
reward = ["exact_match"]
"""


def generated_tokens(url: str, auth: dict[str, str]) -> int:
    info = httpx.get(url + "/get_server_info", trust_env=False, headers=auth).json()
    return info["internal_states"][0]["generated_tokens"]


def test_generation_goes_through_the_sglang_router(ray_cluster, tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    controller = Run(resolve_job(load_job(path)), tmp_path / "run")
    loop = SyncLoop(controller)
    try:
        controller.start()
        router_url = controller.engine_router.base_url
        assert controller.rollout.generate_urls == [router_url]
        assert controller.rollout.one_request_per_sample  # the router takes one sampling_params per request
        engines = controller.actors.engine_urls
        assert router_url not in engines and len(engines) == 2
        # the engines and the router in front of them need the run secret; the run holds it
        auth = {"Authorization": f"Bearer {read_secret_file(tmp_path / 'run')}"}
        assert httpx.post(router_url + "/generate", json={"input_ids": [1, 2], "sampling_params": {}},
                          trust_env=False).status_code == 401
        for step in range(2):
            metrics = loop.run_step(step)
            controller.step = step + 1
            assert metrics["rollout/num_rows"] == 16.0
            # weights still go to each engine directly
            for url in engines:
                version = httpx.get(url + "/get_weight_version", trust_env=False, headers=auth).json()
                assert version["weight_version"] == str(step + 1)
        # round robin over the router: both engines generated
        assert all(generated_tokens(url, auth) > 0 for url in engines)
        assert metrics["train/is_approx_k3_kl"] < 1e-6
    finally:
        controller.close()
    assert controller.engine_router is None


def test_an_engine_that_died_behind_the_sglang_router_is_replaced_there(ray_cluster, tmp_path):
    import ray

    path = tmp_path / "job.toml"
    path.write_text(JOB.replace("total_steps = 2", "total_steps = 3"))
    controller = Run(resolve_job(load_job(path)), tmp_path / "run")
    loop = SyncLoop(controller)
    try:
        controller.start()
        router = controller.engine_router
        assert sorted(router.worker_urls_now()) == sorted(controller.actors.engine_urls)
        history = [loop.run_step(0)]
        controller.step = 1
        dead_url = controller.actors.engine_urls[1]
        victim = controller.actors.engine_actors[1]
        ray.kill(victim)
        while True:  # the kill takes effect asynchronously
            try:
                ray.get(victim.ready.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                break
        for step in (1, 2):
            history.append(loop.run_step(step))
            controller.step = step + 1
        engines = list(controller.actors.engine_urls)
        routed = router.worker_urls_now()
        auth = {"Authorization": f"Bearer {read_secret_file(tmp_path / 'run')}"}
        finished_on_new = generated_tokens(engines[1], auth)
    finally:
        controller.close()
    # the sglang-router was told: it routes to the new engine, not to the dead one
    assert engines[1] != dead_url and sorted(routed) == sorted(engines) and dead_url not in routed
    assert [m["fault/engine_restarts"] for m in history] == [0.0, 1.0, 1.0]
    assert [m["rollout/num_rows"] for m in history] == [16.0, 16.0, 16.0]  # every prompt of every step
    assert finished_on_new > 0  # round robin: the new engine generated
    assert all(m["train/is_approx_k3_kl"] < 1e-6 for m in history)  # it serves the current weights


def test_without_a_router_each_group_is_one_request_to_its_engine(ray_cluster, tmp_path):
    """With no load balancer in front, the fast path sends a group's samples in one ``/generate``
    (the engine prefills the shared prompt once and batches the samples from the first step); one
    request per sample is only for a router that takes one sampling_params per request."""
    path = tmp_path / "job.toml"
    path.write_text(JOB.replace('engine_router = "sglang_router"', "")
                    .replace('engine_router_args = { policy = "round_robin" }', "")
                    .replace("num_engines = 2", "num_engines = 1").replace("total_steps = 2", "total_steps = 1"))
    controller = Run(resolve_job(load_job(path)), tmp_path / "run")
    loop = SyncLoop(controller)
    try:
        controller.start()
        assert controller.engine_router is None
        client = controller.rollout.generate_clients[0]
        assert controller.rollout.generate_urls == controller.actors.engine_urls
        batches: list[int] = []
        real_generate = client.generate

        async def counting_generate(input_ids, *args, **kwargs):  # a spy: the real client answers
            batches.append(len(input_ids))
            return await real_generate(input_ids, *args, **kwargs)

        client.generate = counting_generate
        metrics = loop.run_step(0)
        assert metrics["rollout/num_rows"] == 16.0
        assert batches == [4, 4, 4, 4]  # four prompts, each with its four samples in one request
    finally:
        controller.close()
