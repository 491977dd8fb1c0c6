"""Chat messages as the router compares and renders them.

Agents echo earlier turns back in many equivalent shapes (``content`` ``None`` or ``""``,
re-serialised tool-call arguments, extra SDK fields such as ``refusal``, dropped
``reasoning_content``). :func:`message_key` reduces a message to what changes its meaning so the
router can tell whether a request extends the recorded conversation; :func:`template_message`
turns a message into the shape Hugging Face chat templates expect.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence


def _canonical_arguments(args: Any) -> str:
    """Tool-call arguments as sorted JSON when they parse, else the raw string."""
    if isinstance(args, Mapping):
        return json.dumps(args, sort_keys=True, ensure_ascii=False)
    if isinstance(args, str):
        try:
            return json.dumps(json.loads(args), sort_keys=True, ensure_ascii=False)
        except ValueError:
            return args
    return json.dumps(args, sort_keys=True, default=str)


def content_key(content: Any) -> Any:
    """``content`` in hashable form: a string as it is, a list of parts as ``(kind, text)`` pairs
    (an image by its sha256, so two different images of one size are different content)."""
    if not isinstance(content, list):
        return content or ""
    return tuple((part.get("type"), part.get("sha256") or part.get("text") or "") for part in content)


def content_text(content: Any) -> str:
    """The text a chat template renders for ``content``: a string as it is; a list of parts
    joined, each image by its placeholder tokens (see :mod:`.images`)."""
    if not isinstance(content, list):
        return content or ""
    return "".join(part.get("placeholder", "") if part.get("type") == "image" else part.get("text", "")
                   for part in content)


def message_key(msg: Mapping[str, Any]) -> tuple[Any, ...]:
    """A hashable summary of a message that ignores presentation-only differences.

    ``reasoning_content`` is left out on purpose: agents commonly drop it from their history, and
    the router reuses its recorded tokens for earlier model turns anyway.
    """
    role = msg.get("role")
    if role == "developer":
        role = "system"
    content = content_key(msg.get("content"))
    calls = tuple(
        (str(c.get("id") or ""), c["function"]["name"], _canonical_arguments(c["function"].get("arguments", "")))
        for c in (msg.get("tool_calls") or [])
    )
    return (role, content, calls, msg.get("tool_call_id") or "", msg.get("name") or "")


def same_messages(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> bool:
    """Whether two message lists mean the same conversation (see :func:`message_key`)."""
    return len(a) == len(b) and all(message_key(x) == message_key(y) for x, y in zip(a, b))


def template_message(msg: Mapping[str, Any]) -> dict[str, Any]:
    """``msg`` in the shape chat templates expect.

    ``developer`` becomes ``system``; ``content`` is always a string (images as their placeholder
    tokens); tool-call arguments that are
    JSON objects are passed as dicts (templates such as Llama 3's need a mapping; the Qwen and
    Hermes templates serialise either).
    """
    role = msg["role"]
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": content_text(msg.get("content"))}
    if msg.get("tool_calls"):
        calls = []
        for call in msg["tool_calls"]:
            args: Any = call["function"].get("arguments", "")
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                    if isinstance(parsed, dict):
                        args = parsed
                except ValueError:
                    pass
            calls.append({"id": call.get("id", ""), "type": "function",
                          "function": {"name": call["function"]["name"], "arguments": args}})
        out["tool_calls"] = calls
    for key in ("reasoning_content", "tool_call_id", "name"):
        if msg.get(key):
            out[key] = msg[key]
    return out
