"""What a data row's prompt means as a chat: one rule shared by the host and every agent.

A prompt is a string (one user message) or a list of chat messages (dicts with a ``role``). The
host's single-turn fast path and the agents that talk to the AgentFlow router both turn a prompt
into messages with :func:`prompt_messages`, so the same row renders to the same conversation
whichever way it is generated.
"""

from __future__ import annotations

from typing import Any


def prompt_messages(prompt: Any, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """Chat messages for a prompt: a string becomes one user message, a list of messages is copied.

    ``system_prompt`` is put first as a system message when the messages have none. Anything
    else (a number, a list of non-messages, an empty list) is a ``ValueError`` naming its type.
    """
    if isinstance(prompt, str):
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        what = "an empty list" if isinstance(prompt, list) and not prompt else type(prompt).__name__
        raise ValueError(f"a prompt must be a string or a non-empty list of chat messages, got {what}")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
