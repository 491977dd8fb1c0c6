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
    """The rollout engine component (``torch``, ``sglang``)."""
    num_engines: int = attrs.field(default=1, validator=at_least_one)
    """Engine actors (colocated: at most ``[train] num_workers``)."""
    prompts_per_step: int = attrs.field(default=8, validator=at_least_one)
    """Prompts (groups) per step."""
    samples_per_prompt: int = attrs.field(default=4, validator=at_least_one)
    """Samples per prompt (the group size)."""
    temperature: float = attrs.field(default=1.0, validator=non_negative)
    """Sampling temperature (a source's ``sampling`` table overrides it)."""
    top_p: float = attrs.field(default=1.0, validator=in_range(gt=0, le=1))
    """Nucleus sampling, in (0, 1]."""
    top_k: int = attrs.field(default=-1, validator=in_range(ge=1, extra=(-1,)))
    """Top-k sampling (-1: off)."""
    max_new_tokens: int = attrs.field(default=64, validator=at_least_one)
    """Tokens generated per turn at most."""
    max_context_length: int = attrs.field(default=2048, validator=in_range(ge=2))
    """Longest sequence (prompt plus generation) the engines and the router accept."""
    partial: bool = False
    """Asynchronous runs: at a weight update, unfinished generations keep their tokens and continue under the new
    weights."""
    partial_mask_stale: bool = False
    """With ``partial``: leave the tokens an older policy generated out of the loss."""
    weight_transport: str = component("weight_transport", args="weight_transport_args", default="auto")
    """How new weights reach the engines (``auto``: per engine the best one; ``inprocess``, ``shm``, ``broadcast``,
    ``sglang_*``)."""
    weight_transport_args: Args = attrs.field(factory=dict)
    """Arguments of the weight transport (e.g. ``bucket_bytes``)."""
    engine_args: Args = attrs.field(factory=dict)
    """Arguments of the rollout engine (SGLang: passed as ``--kebab-case`` flags)."""
    engine_router: str = component("engine_router", args="engine_router_args", default="")
    """A load balancer in front of the engines (``sglang_router``); empty: none."""
    engine_router_args: Args = attrs.field(factory=dict)
    """Arguments of the engine router."""


@attrs.define
class DataConfig:
    """One data source. Either ``path`` (a JSONL file, a parquet file, or a directory written by
    ``datasets``' ``save_to_disk``; ``split`` picks one split of a saved ``DatasetDict``) or
    ``generator`` (a procedural task from a plugin) gives the prompts; ``agent``, ``reward`` and
    sampling are per source. ``max_line_bytes`` (default 16 MiB) is the longest JSONL line read:
    a longer one is refused, naming the file and line, before it is held in memory."""

    name: str = "default"
    """The source's name (in metrics, records and errors)."""
    path: str | None = None
    """Rows from a JSONL file, a parquet file or a ``datasets`` ``save_to_disk`` directory (relative to the job
    file)."""
    generator: str | None = component("data_source", args="generator_args", default=None)
    """Rows from a procedural data-source component (``arithmetic``, ...) instead of ``path``."""
    generator_args: Args = attrs.field(factory=dict)
    """Arguments of the generator."""
    weight: float = attrs.field(default=1.0, validator=positive)
    """The source's share of each step's prompts, relative to the other sources."""
    split: str | None = None
    """One split of a saved ``DatasetDict``."""
    prompt_key: str = "prompt"
    """The row field holding the prompt (a string or chat messages)."""
    label_key: str = "label"
    """The row field holding the label rewards compare with (may be absent)."""
    metadata_key: str | None = None
    """The row field holding the metadata object (unset: every other field is metadata)."""
    system_prompt: str | None = None
    """A system message put before every prompt of the source."""
    agent: str = component("agent", args="agent_args", default="single_turn")
    """The agent component that runs each trajectory (``single_turn``, ``tool_agent``, ``command``, ``codex``,
    ``claude_code``, ``opencode``, ...)."""
    agent_args: Args = attrs.field(factory=dict)
    """Arguments of the agent."""
    sandbox: str | None = component("sandbox", args="sandbox_args", default=None)
    """A sandbox component each trajectory gets (``local``); unset: none."""
    sandbox_args: Args = attrs.field(factory=dict)
    """Arguments of the sandbox provider (a relative ``base_dir`` is taken from the job file's directory)."""
    reward: list[str] = component("reward", args="reward_args", factory=lambda: ["exact_match"])
    """Reward components, summed (a name or a list of names)."""
    reward_args: dict[str, Args] = attrs.field(factory=dict)
    """Arguments per reward: ``{ exact_match = { ... } }``."""
    reward_timeout_s: float = attrs.field(default=300.0, validator=positive)
    """Seconds a reward may take per trajectory before the trajectory fails."""
    teacher: str | None = None
    """The ``[[teachers]]`` entry that scores this source's rows (unset: not distilled)."""
    sampling: Args = attrs.field(factory=dict)
    """Sampling settings of this source, over ``[rollout]``'s (``temperature``, ``top_p``, ``top_k``,
    ``max_new_tokens``, and what SGLang accepts)."""
    shuffle: bool = True
    """Draw the rows in a shuffled order each epoch."""
    max_line_bytes: int = attrs.field(default=DEFAULT_MAX_LINE_BYTES, validator=at_least_one)
    """The longest JSONL line read (bytes, newline excluded, 16 MiB by default): a longer one is refused,
    naming the file and line, having held at most this many bytes of it."""


@attrs.define
class AgentFlowConfig:
    """The AgentFlow router: middleware in the listed order, per-trajectory budgets, agent limits.

    ``access_log``: a JSON-lines file that gets one line per router request (method, path,
    status, milliseconds); empty: the log is kept in memory only (``GET /admin/access_log``).
    """

    middleware: list[str] = component("router_middleware", args="middleware_args", factory=list)
    """Router middleware (``reasoning_parser``, ``tool_call_parser``, ``request_logger``), composed in list order."""
    middleware_args: dict[str, Args] = attrs.field(factory=dict)
    """Arguments per middleware: ``{ tool_call_parser = { format = "hermes" } }``."""
    max_response_tokens: int = attrs.field(default=0, validator=in_range(ge=0))
    """Generated tokens per trajectory across its turns (0: no budget beyond ``max_new_tokens`` per turn)."""
    agent_timeout_s: float = attrs.field(default=600.0, validator=positive)
    """Seconds an agent may take per trajectory before it is marked failed."""
    max_concurrent_agents: int = attrs.field(default=64, validator=at_least_one)
    """Agents running at once."""
    port: int = attrs.field(default=0, validator=in_range(ge=0, le=65535))
    """The router's port on 127.0.0.1 (0: a free one)."""
    max_request_bytes: int = attrs.field(default=8 * 1024 * 1024, validator=at_least_one)
    """Larger request bodies get a 413 before they are parsed."""
    max_prompt_chars: int = attrs.field(default=1_000_000, validator=at_least_one)
    """Requests with more message text (and tool schemas) get a 400 before any tokenization."""
    access_log: str = ""
    """A JSON-lines file the router appends one line per request to (method, path, status, ms); empty: kept in
    memory only."""
    max_image_bytes: int = attrs.field(default=10 * 1024 * 1024, validator=at_least_one)
    """Largest image (decoded bytes) a request may carry to a vision-language policy; larger ones get a 400."""
    max_image_pixels: int = attrs.field(default=4096 * 4096, validator=at_least_one)
    """Most pixels (width x height) of one image; larger ones get a 400 before their pixels are decoded."""
    max_images_per_request: int = attrs.field(default=16, validator=at_least_one)
    """Most images in one request (its whole conversation); more get a 400."""


@attrs.define
class AsyncConfig:
    """Asynchronous training: a scheduler bounds staleness to ``stale_steps`` policy versions."""

    enable: bool = False
    """Train asynchronously: the engines keep generating while the trainer trains on the groups the scheduler
    selects."""
    scheduler: str = component("scheduler", args="scheduler_args", active=lambda section, job: section.enable,
                               default="windowed_fifo")
    """The scheduler component (``sync``, ``no_window``, ``window_gated``, ``windowed_fifo``)."""
    scheduler_args: Args = attrs.field(factory=dict)
    """Arguments of the scheduler."""
    stale_steps: int = attrs.field(default=1, validator=in_range(ge=0))
    """No trained group is more than this many policy versions old."""
