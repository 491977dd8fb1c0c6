"""``loongsage serve``: rollout engines and the AgentFlow router, without training.

Starts the job's engines (on the local Ray cluster) and a router in front of them, prints the
router's base URL, an example trajectory URL with its key, and where the run secret is (a 0600
file: the router's ``/admin`` API and the engines need it), and serves until interrupted, so a
user can point any OpenAI-compatible agent at the live policy and inspect what would be recorded.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import attrs

from ..agentflow import AgentFlowRouter, build_middlewares
from ..config import section_refs
from ..hf_models import load_tokenizer
from ..resolve import ResolvedJob
from ..security import new_secret, set_process_secret, write_secret_file
from .placement import Actors, create_actors, init_ray, start_engine_router
from .rollout import router_images
from .signals import stop_on_signals


@attrs.define
class Serving:
    """A running router and its engines; ``trajectory_url`` is a registered debug endpoint and
    ``trajectory_key`` the API key that opens it (and nothing else)."""

    router: AgentFlowRouter
    actors: Actors
    trajectory_id: str
    trajectory_url: str
    trajectory_key: str
    secret_path: Path
    engine_router: Any = None

    def close(self) -> None:
        self.router.shutdown()
        if self.engine_router is not None:
            self.engine_router.shutdown()
        self.actors.shutdown()


def start_serving(resolved: ResolvedJob, port: int = 0, output_dir: str | Path | None = None) -> Serving:
    """Start the engines and the router, and register one debug trajectory.

    The run secret goes to ``output_dir/run_secret`` (default: a fresh private temporary directory).
    """
    job = resolved.job
    tokenizer = load_tokenizer(job)
    secret = new_secret()
    run_dir = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="loongsage-serve-"))
    secret_path = write_secret_file(run_dir, secret)
    set_process_secret(secret)
    init_ray(job)
    actors = create_actors(job, needs_reference=False, secret=secret)
    engine_router, generate_urls = start_engine_router(job, resolved.host, actors.engine_urls, secret=secret)
    af = job.agentflow
    middlewares = build_middlewares(resolved.host, list(section_refs(af, "agentflow", job)), job)
    router = AgentFlowRouter(tokenizer, generate_urls, middlewares,
                             port=port or af.port, max_context_length=job.rollout.max_context_length,
                             secret=secret, max_request_bytes=af.max_request_bytes,
                             max_prompt_chars=af.max_prompt_chars, access_log_path=af.access_log or None,
                             **router_images(job))
    router.start()
    tid = f"debug-{uuid.uuid4().hex[:8]}"
    url = router.blocking.register(tid, max_response_tokens=af.max_response_tokens or None)
    return Serving(router=router, actors=actors, trajectory_id=tid, trajectory_url=url,
                   trajectory_key=router.trajectory_key(tid), secret_path=secret_path, engine_router=engine_router)


def serve_job(resolved: ResolvedJob, port: int = 0, output_dir: str | Path | None = None) -> Any:
    """Serve until interrupted, printing where to point an agent and where the run secret is."""
    serving = start_serving(resolved, port, output_dir)
    base = serving.router.base_url
    print(f"AgentFlow router: {base}", flush=True)
    print(f"engines: {', '.join(serving.actors.engine_urls)}", flush=True)
    print(f"example trajectory endpoint (OPENAI_BASE_URL): {serving.trajectory_url}", flush=True)
    print(f"its key (OPENAI_API_KEY; opens this endpoint only): {serving.trajectory_key}", flush=True)
    print(f"run secret file (mode 0600; /admin and the engines want it as a bearer token): {serving.secret_path}",
          flush=True)
    print(f"what it recorded: curl -H \"Authorization: Bearer $(cat {serving.secret_path})\" "
          f"{base}/admin/trajectories/{serving.trajectory_id}", flush=True)
    stop_on_signals()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serving.close()
