"""Helpers shared by the built-in agents: SDK objects to plain dicts, the OpenAI client.

Prompts become messages by the contract's :func:`loongsage_hookspecs.prompt_messages`, the rule
the host's single-turn fast path uses too.
"""

from __future__ import annotations

from typing import Any


def message_dict(message: Any) -> dict[str, Any]:
    """An SDK ``ChatCompletionMessage`` as the dict an agent sends back in its history."""
    data = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    out: dict[str, Any] = {"role": "assistant", "content": data.get("content")}
    if data.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                             for c in data["tool_calls"]]
    if data.get("reasoning_content"):
        out["reasoning_content"] = data["reasoning_content"]
    return out


def openai_client(ctx: Any, max_retries: int = 2) -> Any:
    """An ``openai.AsyncOpenAI`` client for the trajectory's endpoint."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key or "loongsage", max_retries=max_retries,
                       timeout=ctx.timeout_s if ctx.timeout_s else 600.0)
