"""Rollout: turning a step's prompts into scored trajectory groups.

Single-turn sources take the fast path: the prompt is rendered with the chat template once and
its ``samples_per_prompt`` copies are sent to one engine in one batched ``/generate`` call, so the
engine shares the prompt prefix across the group (the token record is the same one the router
would make for a one-turn conversation). Every other agent runs through the AgentFlow router: it
talks OpenAI chat completions to its trajectory's URL, and the router records the tokens. Every
sampled token keeps its rollout log-prob and the weight version that produced it.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Awaitable, Sequence

from loongsage_hookspecs import Segment, Trajectory, TrajectoryGroup, TrajectoryStatus

from ..config import ConfigError, DataConfig, JobConfig
from ..engine_client import EngineClient
from .data import Prompt
from .rewards import score_trajectory

FAST_PATH_AGENT = "single_turn"


def sample_seed(run_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A per-sample sampling seed, stable across restarts (so resumed runs sample the same)."""
    digest = hashlib.blake2b(f"{run_seed}:{step}:{prompt_index}:{sample_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def render_messages(prompt: Any, source: DataConfig) -> list[dict[str, Any]]:
    """Chat messages for a data row's prompt (a string becomes one user message)."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ConfigError(f"data source '{source.name}': a prompt must be a string or a list of chat messages, "
                          f"got {type(prompt).__name__}")
    if source.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": source.system_prompt})
    return messages


def sampling_params(job: JobConfig, source: DataConfig) -> dict[str, Any]:
    """SGLang ``sampling_params`` for a source: the rollout defaults, overridden per source."""
    params: dict[str, Any] = {
        "temperature": job.rollout.temperature,
        "top_p": job.rollout.top_p,
        "top_k": job.rollout.top_k,
        "max_new_tokens": job.rollout.max_new_tokens,
    }
    params.update(source.sampling)
    return params


class RolloutManager:
    """Generates and scores the groups of one step across the available engines."""

    def __init__(self, job: JobConfig, components: Any, tokenizer: Any, engine_urls: Sequence[str],
                 generate_urls: Sequence[str] | None = None) -> None:
        """``engine_urls``: every engine (control calls: pause, continue, memory release);
        ``generate_urls``: where generation goes (a load balancer in front of them; default the
        engines, round robin)."""
        self.job = job
        self.components = components
        self.tokenizer = tokenizer
        self.clients = [EngineClient(url) for url in engine_urls]
        self.generate_urls = list(generate_urls) if generate_urls else list(engine_urls)
        self.generate_clients = self.clients if not generate_urls else [EngineClient(u) for u in self.generate_urls]
        # a load balancer takes one sampling_params per request (and routes each sample itself)
        self.one_request_per_sample = bool(generate_urls)
        self.sources = {src.name: src for src in job.data}
        eos = tokenizer.eos_token_id
        self.stop_ids = [eos] if eos is not None else []
        self.router: Any = None
        self._sandboxes: dict[str, Any] = {}
        self._agent_slots: asyncio.Semaphore | None = None

    # ------------------------------------------------------------------ AgentFlow path

    def start_router(self) -> str:
        """Start the AgentFlow router (once) in front of the engines; returns its base URL."""
        if self.router is None:
            from ..agentflow import AgentFlowRouter, build_middlewares

            af = self.job.agentflow
            entries = [{"name": n, "args": af.middleware_args.get(n, {})} for n in af.middleware]
            self.router = AgentFlowRouter(self.tokenizer, self.generate_urls,
                                          build_middlewares(self.components, entries),
                                          port=af.port, max_context_length=self.job.rollout.max_context_length,
                                          access_log_path=af.access_log or None)
            self.router.start()
        return str(self.router.base_url)

    def _sandbox_provider(self, source: DataConfig) -> Any:
        if not source.sandbox:
            return None
        if source.name not in self._sandboxes:
            spec = self.components.get("sandbox", source.sandbox)
            self._sandboxes[source.name] = spec.factory(**source.sandbox_args)
        return self._sandboxes[source.name]

    async def _agent_group(self, prompt: Prompt, index: int, step: int) -> TrajectoryGroup:
        from ..agentflow import run_agent_trajectory

        self.start_router()
        source = self.sources[prompt.source]
        spec = self.components.get("agent", source.agent)
        af = self.job.agentflow
        if self._agent_slots is None:
            self._agent_slots = asyncio.Semaphore(max(1, af.max_concurrent_agents))
        group_id = f"{step}:{index}"
        group = TrajectoryGroup(group_id=group_id, prompt_id=prompt.prompt_id, source=prompt.source)

        async def one(j: int) -> Trajectory:
            traj = Trajectory(id=f"{step}-{index}-{j}", prompt_id=prompt.prompt_id, group_id=group_id,
                              source=prompt.source, prompt=prompt.prompt, label=prompt.label,
                              metadata=dict(prompt.metadata))
            params = sampling_params(self.job, source)
            params["seed"] = sample_seed(self.job.run.seed, step, index, j)
            # the policy is sampled with the job's settings, whatever the agent asks for
            params["locked"] = True
            assert self._agent_slots is not None
            async with self._agent_slots:
                traj = await run_agent_trajectory(
                    self.router, spec, source.agent_args, self._sandbox_provider(source), trajectory=traj,
                    sampling=params, max_response_tokens=af.max_response_tokens or None,
                    max_context_length=self.job.rollout.max_context_length, timeout_s=af.agent_timeout_s)
            if traj.status == TrajectoryStatus.COMPLETED:
                score_trajectory(traj, source, self.components)
            return traj

        group.trajectories = list(await asyncio.gather(*(one(j) for j in range(self.job.rollout.samples_per_prompt))))
        return group

    def encode_prompt(self, prompt: Prompt, max_new_tokens: int) -> list[int]:
        """The prompt's chat-template tokens; too long to leave room for ``max_new_tokens`` is an error."""
        messages = render_messages(prompt.prompt, self.sources[prompt.source])
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        limit = self.job.rollout.max_context_length - int(max_new_tokens)
        if len(tokens) > limit:
            raise ConfigError(f"prompt '{prompt.prompt_id}' has {len(tokens)} tokens, more than the "
                              f"{limit} that rollout.max_context_length ({self.job.rollout.max_context_length}) "
                              f"leaves after max_new_tokens")
        return tokens

    async def _group(self, client: EngineClient, prompt: Prompt, index: int, step: int) -> TrajectoryGroup:
        source = self.sources[prompt.source]
        n = self.job.rollout.samples_per_prompt
        base = sampling_params(self.job, source)
        tokens = self.encode_prompt(prompt, base["max_new_tokens"])
        params = []
        for j in range(n):
            p = dict(base)
            p["stop_token_ids"] = list(self.stop_ids) + list(p.get("stop_token_ids", []))
            p["sampling_seed"] = sample_seed(self.job.run.seed, step, index, j)
            params.append(p)
        group_id = f"{step}:{index}"
        rids = [f"{group_id}:{j}" for j in range(n)]
        if self.one_request_per_sample:
            answers = await asyncio.gather(*(client.generate([tokens], params[j], return_logprob=True, rids=[rids[j]])
                                             for j in range(n)))
            results = [a[0] for a in answers]
        else:
            results = await client.generate([tokens] * n, params, return_logprob=True, rids=rids)
        group = TrajectoryGroup(group_id=group_id, prompt_id=prompt.prompt_id, source=prompt.source)
        for j, res in enumerate(results):
            seg = Segment()
            seg.append(tokens, generated=False)
            versions = res.weight_versions if res.weight_versions else res.weight_version
            seg.append(res.output_ids, generated=True, logprobs=res.logprobs, weight_version=versions)
            traj = Trajectory(id=rids[j], prompt_id=prompt.prompt_id, group_id=group_id, source=prompt.source,
                              prompt=prompt.prompt, label=prompt.label, segments=[seg],
                              metadata={**prompt.metadata, "prefix_cache": {"prompt_tokens": len(tokens),
                                                                            "cached_tokens": res.cached_tokens}},
                              response_text=self.tokenizer.decode(res.output_ids, skip_special_tokens=True),
                              finish_reason=res.finish_reason)
            traj.status = TrajectoryStatus.ABORTED if res.finish_reason == "abort" else TrajectoryStatus.COMPLETED
            if traj.status == TrajectoryStatus.COMPLETED:
                score_trajectory(traj, source, self.components)
            group.trajectories.append(traj)
        return group

    def group(self, prompt: Prompt, index: int, step: int) -> Awaitable[TrajectoryGroup]:
        """The coroutine producing group ``index`` of ``step``: the single-turn fast path on engine
        ``index`` (round robin), or the source's agent through the router."""
        if self.sources[prompt.source].agent == FAST_PATH_AGENT:
            clients = self.generate_clients
            return self._group(clients[index % len(clients)], prompt, index, step)
        return self._agent_group(prompt, index, step)

    async def generate(self, prompts: Sequence[Prompt], step: int, offset: int = 0) -> list[TrajectoryGroup]:
        """All groups for ``prompts``; groups are spread round-robin over the engines."""
        return list(await asyncio.gather(*(self.group(p, offset + i, step) for i, p in enumerate(prompts))))

    async def aclose(self) -> None:
        for c in {id(c): c for c in (*self.clients, *self.generate_clients)}.values():
            await c.aclose()
        if self.router is not None:
            self.router.shutdown()
            self.router = None
