"""What the router's answers must look like, checked against the protocols' own definitions.

* Responses: the OpenResponses specification, as the JSON Schema kept in
  ``schemas/openresponses.json`` (``check_response``, ``check_response_event``).
* Chat Completions and Anthropic Messages: the official SDKs' pydantic types, in strict mode
  (``check_chat``, ``check_chat_chunk``, ``check_message``, ``check_message_event``).

``collect_sse(response)`` reads a raw server-sent-events answer into ``(event name, data)``
pairs, so a test sees every event exactly as the router sent it (the SDKs drop what they do not
know).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Iterable

SCHEMA_PATH = Path(__file__).parent / "schemas" / "openresponses.json"


@functools.cache
def _schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


@functools.cache
def _validator(definition: str) -> Any:
    from jsonschema import Draft202012Validator

    root = _schema()
    schema = {"$schema": root["$schema"], "$defs": root["$defs"], "$ref": f"#/$defs/{definition}"}
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def schema_errors(definition: str, obj: Any) -> list[str]:
    """Every way ``obj`` breaks ``definition`` of the OpenResponses schema (empty: it conforms)."""
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in _validator(definition).iter_errors(obj)]


def check_response(obj: Any) -> None:
    """``obj`` is an OpenResponses ``response`` object."""
    errors = schema_errors("ResponseResource", obj)
    assert not errors, errors


def check_response_event(event: Any) -> None:
    """``event`` is one of the specification's streaming events, and so is the response it carries."""
    kind = event.get("type") if isinstance(event, dict) else None
    definition = f"event:{kind}"
    assert definition in _schema()["$defs"], f"not an OpenResponses streaming event: {kind!r}"
    errors = schema_errors(definition, event)
    assert not errors, (kind, errors)


def check_chat(obj: Any) -> Any:
    from openai.types.chat import ChatCompletion

    return ChatCompletion.model_validate(obj, strict=True)


def check_chat_chunk(obj: Any) -> Any:
    from openai.types.chat import ChatCompletionChunk

    return ChatCompletionChunk.model_validate(obj, strict=True)


def check_message(obj: Any) -> Any:
    from anthropic.types import Message

    return Message.model_validate(obj, strict=True)


def check_message_event(obj: Any) -> Any:
    """One Anthropic stream event: a ``ping`` (which the API sends and the SDK skips) or one of
    the SDK's ``RawMessageStreamEvent`` types."""
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    if obj == {"type": "ping"}:
        return obj
    return TypeAdapter(RawMessageStreamEvent).validate_python(obj, strict=True)


def collect_sse(lines: Iterable[str]) -> list[tuple[str | None, Any]]:
    """``(event name, parsed data)`` of every event of a server-sent-events body (``"[DONE]"``
    stays a string)."""
    events: list[tuple[str | None, Any]] = []
    name: str | None = None
    for line in lines:
        if line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data = line.removeprefix("data:").strip()
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return events
