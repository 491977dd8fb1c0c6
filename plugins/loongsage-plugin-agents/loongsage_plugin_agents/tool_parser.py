"""Router middleware that turns tool calls written in the model's text into OpenAI ``tool_calls``.

The router returns the model's raw text; models write tool calls in their own syntax. This
middleware parses one of these formats and rewrites the response message the OpenAI way:
``content`` keeps the text outside the calls (``None`` if nothing is left), ``tool_calls`` lists
``{"id", "type": "function", "function": {"name", "arguments": "<JSON string>"}}`` and
``finish_reason`` becomes ``"tool_calls"``. A block that is not valid JSON stays in the content,
so the agent (and the reward) sees exactly what the model wrote.

White space: the content is always stripped at both ends while the parser is active, whether or
not a call was found. Parsers strip around the calls they take out; stripping every answer the
same way makes the content of a text a pure function of it that only grows as the text grows
(trailing white space aside), so a streamed answer adds up to exactly the non-streamed one.

Formats:

* ``hermes`` (Qwen 2.5/3, Hermes, the test tokenizer): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of blocks anywhere in the text.
* ``llama3_json`` (Llama 3.x JSON tool calling): the whole message is one JSON object
  ``{"name": ..., "parameters": {...}}`` (or several separated by ``;``), optionally after ``<|python_tag|>``.
* ``mistral``: text, then ``[TOOL_CALLS]`` and a JSON list ``[{"name": ..., "arguments": {...}}, ...]``.

Parsing is skipped when the request has no ``tools``. With ``tool_choice`` ``"none"`` (the router
then renders the prompt without tools) no call is returned, and any call markup the model wrote
anyway is taken out of the content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Callable

FORMATS = ("hermes", "llama3_json", "mistral")

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _call(name: Any, args: Any) -> dict[str, Any] | None:
    """An OpenAI tool call, or ``None`` when ``name``/``args`` are not a valid call."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_hermes(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Parse ``<tool_call>`` blocks; returns the remaining text and the calls."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def parse_llama3_json(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Parse a message that is entirely JSON tool calls (``{"name", "parameters"}``)."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) if isinstance(obj, dict) else None
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return "", calls


def parse_mistral(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Parse ``[TOOL_CALLS][{"name", "arguments"}, ...]`` after optional text."""
    marker = "[TOOL_CALLS]"
    at = text.find(marker)
    if at < 0:
        return text, []
    try:
        items = json.loads(text[at + len(marker):].strip())
    except ValueError:
        return text, []
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list):
        return text, []
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return text, []
        call = _call(item.get("name"), item.get("arguments", item.get("parameters")))
        if call is None:
            return text, []
        calls.append(call)
    return text[:at].strip(), calls


PARSERS: dict[str, Callable[[str], tuple[str, list[dict[str, Any]]]]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}

_HERMES_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


def without_markup(text: str, format: str) -> str:
    """``text`` with every tool call of ``format`` taken out, valid or not (an unclosed one at the
    end too): what a turn that may not call tools shows."""
    if format == "hermes":
        text = _HERMES_BLOCK.sub("", text)
        at = text.find("<tool_call>")
        return text if at < 0 else text[:at]
    if format == "mistral":
        at = text.find("[TOOL_CALLS]")
        return text if at < 0 else text[:at]
    rest, calls = parse_llama3_json(text)
    return rest if calls else text


SYNTAX: dict[str, tuple[str, str, str, str]] = {
    "hermes": ("<tool_call>\n", "\n</tool_call>", "\n", "arguments"),
    "llama3_json": ("", "", "; ", "parameters"),
    "mistral": ("[TOOL_CALLS][", "]", "", "arguments"),
}
"""How each format writes a call: ``(begin, end, separator, arguments key)``; a call is ``begin +
{"name": ..., key: {...}} + end`` and several are joined by ``separator`` (empty: one call per
answer, as a forced mistral answer is one ``[TOOL_CALLS]`` list)."""


class ToolCallParser:
    """Router middleware: parse tool calls out of the model's text (see the module docstring).

    Args:
        format: one of :data:`FORMATS`.
        known_tools_only: leave calls to functions the request did not offer in the text.
    """

    def __init__(self, format: str = "hermes", known_tools_only: bool = False) -> None:
        if format not in PARSERS:
            raise ValueError(f"tool_call_parser: unknown format {format!r}; choose one of {', '.join(FORMATS)}")
        self.format = format
        self.parse = PARSERS[format]
        self.known_tools_only = known_tools_only

    def on_request(self, trajectory_id: str, request: dict[str, Any]) -> dict[str, Any]:
        return request

    def tool_call_syntax(self, request: dict[str, Any]) -> tuple[str, str, str, str] | None:
        """How the model writes a call in this format, so the router can force one by constrained
        decoding (``tool_choice`` ``required`` or a named function): ``(begin, end, separator,
        arguments key)``, what :func:`parse_hermes` / :func:`parse_llama3_json` /
        :func:`parse_mistral` read back."""
        return SYNTAX[self.format]

    def stream_holdback(self, request: dict[str, Any], text: str) -> int:
        """While streaming: hold back a tool call being written (from its marker on) and a tail
        that may be the start of a marker, so no call text reaches the agent as content."""
        if not request.get("tools"):
            return 0
        if self.format == "llama3_json":
            body = text.lstrip()
            if body.startswith(("{", "<|python_tag|>")) or "{".startswith(body) or "<|python_tag|>".startswith(body):
                return len(text)
            return 0
        marker = "<tool_call>" if self.format == "hermes" else "[TOOL_CALLS]"
        at = text.rfind(marker)
        if at >= 0 and (self.format == "mistral" or "</tool_call>" not in text[at:]):
            return len(text) - at
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-n:]):
                return n
        return 0

    def on_response(self, trajectory_id: str, request: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
        if not request.get("tools"):
            return response
        choice = response["choices"][0]
        message = choice["message"]
        content = message.get("content")
        if not isinstance(content, str):
            return response
        if request.get("tool_choice") == "none":  # no calls: markup the model wrote anyway is dropped
            message["content"] = without_markup(content, self.format).strip()
            return response
        rest, calls = self.parse(content)
        if self.known_tools_only:
            names = {t.get("function", {}).get("name") for t in request["tools"]}
            if any(c["function"]["name"] not in names for c in calls):
                rest, calls = content, []
        rest = rest.strip()
        if not calls:
            message["content"] = rest
            return response
        message["content"] = rest or None
        message["tool_calls"] = calls
        if choice.get("finish_reason") == "stop":
            choice["finish_reason"] = "tool_calls"
        return response
