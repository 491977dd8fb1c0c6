"""The job file's rollout tables: how samples are generated.

``[rollout]`` (the engines and sampling), ``[[data]]`` (the data sources, each with its agent,
sandbox and rewards), ``[agentflow]`` (the router agents talk to) and ``[async]`` (asynchronous
training). Each table is an attrs class whose fields carry the validators of :mod:`.fields`;
:class:`~.job.JobConfig` gathers them into a job.
"""

from __future__ import annotations

import attrs

from .fields import Args, at_least_one, component, in_range, non_negative, positive

DEFAULT_MAX_LINE_BYTES = 16 * 2**20
"""The longest JSONL data line (bytes, newline excluded) read by default (``[[data]] max_line_bytes``)."""


@attrs.define
class RolloutConfig:
    """Rollout settings: ``prompts_per_step`` prompts x ``samples_per_prompt`` samples each step.

    ``partial`` (asynchronous runs): at a weight update unfinished generations keep their tokens and
    continue under the new weights; ``partial_mask_stale`` then leaves the tokens an older policy
    generated out of the loss, training only on the part the newest policy wrote.

    ``engine_router`` (empty: none) names a load balancer started in front of the engines (the
    sglang plugin's ``sglang_router``); generation goes through it, weight updates and other
    control calls go to each engine."""

    engine: str = component("rollout_engine", default="torch")
    num_engines: int = attrs.field(default=1, validator=at_least_one)
    prompts_per_step: int = attrs.field(default=8, validator=at_least_one)
    samples_per_prompt: int = attrs.field(default=4, validator=at_least_one)
    temperature: float = attrs.field(default=1.0, validator=non_negative)
    top_p: float = attrs.field(default=1.0, validator=in_range(gt=0, le=1))
    top_k: int = attrs.field(default=-1, validator=in_range(ge=1, extra=(-1,)))
    max_new_tokens: int = attrs.field(default=64, validator=at_least_one)
    max_context_length: int = attrs.field(default=2048, validator=in_range(ge=2))
    partial: bool = False
    partial_mask_stale: bool = False
    weight_transport: str = component("weight_transport", args="weight_transport_args", default="auto")
    weight_transport_args: Args = attrs.field(factory=dict)
    engine_args: Args = attrs.field(factory=dict)
    engine_router: str = component("engine_router", args="engine_router_args", default="")
    engine_router_args: Args = attrs.field(factory=dict)


@attrs.define
class DataConfig:
    """One data source. Either ``path`` (a JSONL file, a parquet file, or a directory written by
    ``datasets``' ``save_to_disk``; ``split`` picks one split of a saved ``DatasetDict``) or
    ``generator`` (a procedural task from a plugin) gives the prompts; ``agent``, ``reward`` and
    sampling are per source. ``max_line_bytes`` (default 16 MiB) is the longest JSONL line read:
    a longer one is refused, naming the file and line, before it is held in memory."""

    name: str = "default"
    path: str | None = None
    generator: str | None = component("data_source", args="generator_args", default=None)
    generator_args: Args = attrs.field(factory=dict)
    weight: float = attrs.field(default=1.0, validator=positive)
    split: str | None = None
    prompt_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str | None = None
    system_prompt: str | None = None
    agent: str = component("agent", args="agent_args", default="single_turn")
    agent_args: Args = attrs.field(factory=dict)
    sandbox: str | None = component("sandbox", args="sandbox_args", default=None)
    sandbox_args: Args = attrs.field(factory=dict)
    reward: list[str] = component("reward", args="reward_args", factory=lambda: ["exact_match"])
    reward_args: dict[str, Args] = attrs.field(factory=dict)
    reward_timeout_s: float = attrs.field(default=300.0, validator=positive)
    teacher: str | None = None
    sampling: Args = attrs.field(factory=dict)
    shuffle: bool = True
    max_line_bytes: int = attrs.field(default=DEFAULT_MAX_LINE_BYTES, validator=at_least_one)


@attrs.define
class AgentFlowConfig:
    """The AgentFlow router: middleware in the listed order, per-trajectory budgets, agent limits.

    ``access_log``: a JSON-lines file that gets one line per router request (method, path,
    status, milliseconds); empty: the log is kept in memory only (``GET /admin/access_log``).
    """

    middleware: list[str] = component("router_middleware", args="middleware_args", factory=list)
    middleware_args: dict[str, Args] = attrs.field(factory=dict)
    max_response_tokens: int = attrs.field(default=0, validator=in_range(ge=0))
    agent_timeout_s: float = attrs.field(default=600.0, validator=positive)
    max_concurrent_agents: int = attrs.field(default=64, validator=at_least_one)
    port: int = attrs.field(default=0, validator=in_range(ge=0, le=65535))
    # requests bigger than this get a 413, conversations with more text a 400, before tokenizing
    max_request_bytes: int = attrs.field(default=8 * 1024 * 1024, validator=at_least_one)
    max_prompt_chars: int = attrs.field(default=1_000_000, validator=at_least_one)
    access_log: str = ""  # a file the router appends its access log to (JSON lines); "" keeps it in memory


@attrs.define
class AsyncConfig:
    """Asynchronous training: a scheduler bounds staleness to ``stale_steps`` policy versions."""

    enable: bool = False
    scheduler: str = component("scheduler", args="scheduler_args", active=lambda section, job: section.enable,
                               default="windowed_fifo")
    scheduler_args: Args = attrs.field(factory=dict)
    stale_steps: int = attrs.field(default=1, validator=in_range(ge=0))
