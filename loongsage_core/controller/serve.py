"""``loongsage serve``: rollout engines and the AgentFlow router, without training.

Starts the job's engines (on the local Ray cluster) and a router in front of them, prints the
router's base URL and an example trajectory URL, and serves until interrupted, so a user can point
any OpenAI-compatible agent at the live policy and inspect what would be recorded.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import attrs

from ..agentflow import AgentFlowRouter, build_middlewares
from ..resolve import ResolvedJob
from .placement import Actors, create_actors, init_ray, start_engine_router
from .run import load_tokenizer


@attrs.define
class Serving:
    """A running router and its engines; ``trajectory_url`` is a registered debug endpoint."""

    router: AgentFlowRouter
    actors: Actors
    trajectory_id: str
    trajectory_url: str
    engine_router: Any = None

    def close(self) -> None:
        self.router.shutdown()
        if self.engine_router is not None:
            self.engine_router.shutdown()
        self.actors.shutdown()


def start_serving(resolved: ResolvedJob, port: int = 0) -> Serving:
    """Start the engines and the router, and register one debug trajectory."""
    job = resolved.job
    tokenizer = load_tokenizer(job)
    init_ray(job)
    actors = create_actors(job, needs_reference=False)
    engine_router, generate_urls = start_engine_router(job, resolved.host, actors.engine_urls)
    af = job.agentflow
    entries = [{"name": n, "args": af.middleware_args.get(n, {})} for n in af.middleware]
    router = AgentFlowRouter(tokenizer, generate_urls, build_middlewares(resolved.host, entries),
                             port=port or af.port, max_context_length=job.rollout.max_context_length)
    router.start()
    tid = f"debug-{uuid.uuid4().hex[:8]}"
    url = router.register(tid, max_response_tokens=af.max_response_tokens or None)
    return Serving(router=router, actors=actors, trajectory_id=tid, trajectory_url=url, engine_router=engine_router)


def serve_job(resolved: ResolvedJob, port: int = 0) -> Any:
    """Serve until interrupted, printing where to point an agent."""
    serving = start_serving(resolved, port)
    base = serving.router.base_url
    print(f"AgentFlow router: {base}", flush=True)
    print(f"engines: {', '.join(serving.actors.engine_urls)}", flush=True)
    print(f"example trajectory endpoint (OPENAI_BASE_URL): {serving.trajectory_url}", flush=True)
    print(f"what it recorded: GET {base}/admin/trajectories/{serving.trajectory_id}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serving.close()
