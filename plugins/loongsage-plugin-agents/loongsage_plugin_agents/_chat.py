"""Helpers shared by the built-in agents: prompts to messages, SDK objects to plain dicts."""

from __future__ import annotations

from typing import Any


def prompt_messages(prompt: Any, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """Chat messages for a data row's prompt: a string becomes one user message."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


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
