"""Records an agent and its sandbox exchange with the host: what an agent receives for one
trajectory (:class:`AgentContext`), what it returns (:class:`AgentResult`), and the outcome of one
sandbox command (:class:`ExecResult`)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define
class ExecResult:
    """Outcome of one sandbox command (``exit_code`` 124 and ``timed_out`` when it ran past its
    time limit; ``truncated`` when the output went past the sandbox's cap and was cut)."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False


@attrs.define
class AgentContext:
    """What an agent receives for one trajectory.

    ``base_url`` is the trajectory's OpenAI-compatible endpoint (``.../{trajectory_id}/{attempt}/v1``)
    and ``api_key`` the key to send; the agent talks plain chat completions to it. ``sandbox`` is
    the sandbox the framework created for this trajectory (or ``None``); the framework scores the
    trajectory (rewards that need the sandbox run in it) and then destroys it, also when the agent
    raises or times out.
    """

    trajectory_id: str
    base_url: str
    api_key: str
    prompt: Any
    label: Any = None
    metadata: dict[str, Any] = attrs.field(factory=dict)
    sampling: dict[str, Any] = attrs.field(factory=dict)
    sandbox: Any = None
    timeout_s: float | None = None


@attrs.define
class AgentResult:
    """What an agent returns: its final answer text and conversation, for the reward."""

    response_text: str = ""
    messages: list[dict[str, Any]] = attrs.field(factory=list)
    metadata: dict[str, Any] = attrs.field(factory=dict)
