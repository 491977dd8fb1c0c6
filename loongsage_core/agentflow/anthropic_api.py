"""Anthropic's Messages API (``POST .../v1/messages``, what Claude Code speaks) as a thin adapter.

A request is translated into one chat-completions turn of the trajectory (tokens, loss masks and
segments are recorded as for any other protocol) and the answer back into a ``message`` object or
Anthropic's event stream. ``POST .../v1/messages/count_tokens`` counts the prompt tokens the same
request would send to the engine. ``?beta=true`` and the headers Claude Code sends
(``anthropic-version``, ``anthropic-beta``, ``x-api-key``) are accepted; errors come in
Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``, see :mod:`.errors`).

Translation: ``system`` (a string or text blocks) becomes the system message. User content blocks
``text`` become a user message and each ``tool_result`` a ``tool`` message; assistant blocks
``text``, ``tool_use`` (its ``input`` as JSON arguments) and ``thinking`` (``reasoning_content``)
become one assistant message. ``tools`` (``input_schema``) become function tools,
``tool_choice`` ``auto``/``any``/``tool``/``none`` the chat equivalents, ``stop_sequences`` stop
strings. A final assistant message is a prefill: the model continues it (``continue_final_message``).
The answer's reasoning, text and tool calls become ``thinking``, ``text`` and ``tool_use`` blocks;
``stop_reason`` is ``end_turn``, ``max_tokens``, ``stop_sequence`` or ``tool_use``; ``usage``
counts the prompt tokens the engine's prefix cache served as ``cache_read_input_tokens``.
"""

from __future__ import annotations

import functools
import json
import uuid
from typing import Any, Mapping

from .errors import RouterError, anthropic_error_body, bad_request
from .openai_api import MAX_TOKENS_LIMIT, parse_response_format
from .protocol import json_response, read_json, serve_turn
from .streaming import BlockStream

_SUPPORTED = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
              "stream", "tools", "tool_choice"}
# Accepted without effect on generation (Claude Code sends several of them).
_IGNORED = {"metadata", "thinking", "service_tier", "cache_control", "context_management", "output_config",
            "betas", "speed", "inference_geo", "diagnostics"}
_NEUTRAL = {"container": lambda v: v is None, "mcp_servers": lambda v: not v}
_COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "context_management",
                 "output_config", "betas", "cache_control", "mcp_servers"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _blocks(content: Any, param: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{param}: Input should be a valid string or list of content blocks", param=param)
    for j, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise bad_request(f"{param}.{j}: a content block must be an object with a 'type'", param=f"{param}.{j}")
    return content


def _text_of(content: Any, param: str) -> str:
    out = []
    for j, block in enumerate(_blocks(content, param)):
        if block["type"] != "text":
            raise bad_request(f"{param}.{j}: content blocks of type {json.dumps(block['type'])} are not supported "
                              "here (only 'text')", param=f"{param}.{j}.type")
        if not isinstance(block.get("text"), str):
            raise bad_request(f"{param}.{j}.text: Field required", param=f"{param}.{j}.text")
        out.append(block["text"])
    return "".join(out)


def _image_part(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    """An Anthropic ``image`` block as a chat-completions ``image_url`` part (a base64 data URL);
    a ``url`` source is refused (the router never fetches)."""
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise bad_request(f"{param}.source: Field required", param=f"{param}.source")
    if source.get("type") == "url":
        raise bad_request(f"{param}.source: remote image URLs are not fetched; send the image as a base64 source",
                          param=f"{param}.source", code="remote_image_url")
    if source.get("type") != "base64" or not isinstance(source.get("data"), str) \
            or not isinstance(source.get("media_type"), str):
        raise bad_request(f"{param}.source: an image source must be {{type: 'base64', media_type, data}}",
                          param=f"{param}.source")
    return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}


def _user_content(parts: list[dict[str, Any]]) -> Any:
    """A user message's content: the text when there is no image, else the list of parts."""
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _tool_result(block: Mapping[str, Any], param: str) -> Any:
    """A ``tool_result`` block's content as a tool message's: its text (``Error: `` first when
    ``is_error``), or, when it holds ``image`` blocks (a screenshot), text and image parts."""
    result = block.get("content", "")
    items = _blocks(result, param) if result else []
    if not any(item["type"] == "image" for item in items):
        text = _text_of(result, param) if result else ""
        return f"Error: {text}" if block.get("is_error") else text
    parts = [{"type": "text", "text": "Error: "}] if block.get("is_error") else []
    for k, item in enumerate(items):
        parts.append(_image_part(item, f"{param}.{k}") if item["type"] == "image"
                     else {"type": "text", "text": _text_of([item], f"{param}.{k}")})
    return parts


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages for Anthropic ``messages`` (roles ``user`` and ``assistant``; ``system`` after the first)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: at least one message is required", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        p = f"messages.{i}"
        if not isinstance(msg, Mapping):
            raise bad_request(f"{p}: a message must be an object", param=p)
        role = msg.get("role")
        if role == "system" and i > 0:
            # Claude Code 2.1 sends system messages between turns (environment notes). The chat
            # templates of the models served here place a system prompt first only, so such a
            # message is rendered in place, as a user turn with its text.
            out.append({"role": "user", "content": _text_of(msg.get("content"), f"{p}.content")})
            continue
        if role not in ("user", "assistant"):
            raise bad_request(f"{p}.role: Input should be 'user' or 'assistant' (got {json.dumps(role)}; put "
                              "system prompts in the top-level 'system' field)", param=f"{p}.role")
        blocks = _blocks(msg.get("content"), f"{p}.content")
        if role == "user":
            texts: list[dict[str, Any]] = []
            for j, block in enumerate(blocks):
                kind = block["type"]
                if kind == "text":
                    texts.append({"type": "text", "text": _text_of([block], f"{p}.content")})
                elif kind == "image":
                    texts.append(_image_part(block, f"{p}.content.{j}"))
                elif kind == "tool_result":
                    if texts:  # text before a result: keep the order
                        out.append({"role": "user", "content": _user_content(texts)})
                        texts = []
                    if not isinstance(block.get("tool_use_id"), str):
                        raise bad_request(f"{p}.content.{j}.tool_use_id: Field required",
                                          param=f"{p}.content.{j}.tool_use_id")
                    content = _tool_result(block, f"{p}.content.{j}.content")
                    out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
                else:
                    raise bad_request(f"{p}.content.{j}: content blocks of type {json.dumps(kind)} are not supported "
                                      "in user messages (supported: text, image, tool_result)",
                                      param=f"{p}.content.{j}.type")
            if texts:
                out.append({"role": "user", "content": _user_content(texts)})
            continue
        answer: dict[str, Any] = {"role": "assistant", "content": None}
        for j, block in enumerate(blocks):
            kind = block["type"]
            if kind == "text":
                answer["content"] = (answer["content"] or "") + _text_of([block], f"{p}.content")
            elif kind == "tool_use":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise bad_request(f"{p}.content.{j}: tool_use needs 'id' and 'name'", param=f"{p}.content.{j}")
                args = block.get("input", {})
                if not isinstance(args, Mapping):
                    raise bad_request(f"{p}.content.{j}.input: Input should be a valid dictionary",
                                      param=f"{p}.content.{j}.input")
                answer.setdefault("tool_calls", []).append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
            elif kind == "thinking":
                if not isinstance(block.get("thinking"), str):
                    raise bad_request(f"{p}.content.{j}.thinking: Field required", param=f"{p}.content.{j}.thinking")
                answer["reasoning_content"] = block["thinking"]
            elif kind == "redacted_thinking":
                continue
            else:
                raise bad_request(f"{p}.content.{j}: content blocks of type {json.dumps(kind)} are not supported in "
                                  "assistant messages (supported: text, tool_use, thinking)",
                                  param=f"{p}.content.{j}.type")
        out.append(answer)
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools: Input should be a valid list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        p = f"tools.{i}"
        if not isinstance(tool, Mapping):
            raise bad_request(f"{p}: a tool must be an object", param=p)
        if tool.get("type") not in (None, "custom"):
            raise bad_request(f"{p}: tools of type {json.dumps(tool.get('type'))} are not supported; only custom "
                              "tools with an 'input_schema' are", param=f"{p}.type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"{p}.name: Field required", param=f"{p}.name")
        if not isinstance(tool.get("input_schema"), Mapping):
            raise bad_request(f"{p}.input_schema: Field required (a JSON schema object)", param=f"{p}.input_schema")
        fn: dict[str, Any] = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        fn["parameters"] = dict(tool["input_schema"])
        out.append({"type": "function", "function": fn})
    return out or None


def chat_tool_choice(value: Any) -> Any:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad_request("tool_choice: expected {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                      "\"name\": ...}", param="tool_choice")


def _system(value: Any) -> str | None:
    if value is None:
        return None
    return _text_of(value, "system")


def _check_fields(body: Any, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise bad_request("the request body must be a JSON object")
    for key in body:
        if key not in allowed:
            raise bad_request(f"{key}: Extra inputs are not permitted", param=key)
    for key, neutral in _NEUTRAL.items():
        if key in body and not neutral(body[key]):
            raise bad_request(f"{key}: not supported by this endpoint", param=key)
    return body


def chat_request(body: Any, *, counting: bool = False) -> dict[str, Any]:
    """The chat-completions body for an Anthropic Messages request (or a ``count_tokens`` one)."""
    body = _check_fields(body, _COUNT_FIELDS if counting else _SUPPORTED | _IGNORED | set(_NEUTRAL))
    if not isinstance(body.get("model"), str):
        raise bad_request("model: Field required", param="model")
    if not counting:
        mt = body.get("max_tokens")
        if not isinstance(mt, int) or isinstance(mt, bool) or not 1 <= mt <= MAX_TOKENS_LIMIT:
            raise bad_request(f"max_tokens: Field required (an integer in [1, {MAX_TOKENS_LIMIT}])",
                              param="max_tokens")
    system = _system(body.get("system"))
    chat: dict[str, Any] = {"model": body["model"], "messages": ([{"role": "system", "content": system}]
                                                                 if system else []) + chat_messages(body["messages"])
                            if "messages" in body else chat_messages(None)}
    if not counting:
        chat["max_tokens"] = body["max_tokens"]
        for key in ("temperature", "top_p", "top_k", "stream"):
            if body.get(key) is not None:
                chat[key] = body[key]
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise bad_request("stop_sequences: Input should be a list of non-empty strings", param="stop_sequences")
            if stops:
                chat["stop"] = stops
    last = chat["messages"][-1]
    if last["role"] == "assistant" and (last.get("content") or last.get("tool_calls")):  # a prefill: continued
        where = f"messages.{len(body['messages']) - 1}"
        if last.get("tool_calls") or last.get("reasoning_content"):
            raise bad_request(f"{where}: a final assistant message (a prefill) may hold text blocks only",
                              param="messages")
        if last["content"] != last["content"].rstrip():
            raise bad_request(f"{where}: final assistant content cannot end with trailing whitespace",
                              param="messages")
        chat["continue_final_message"] = True
    tools = chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = chat_tool_choice(body.get("tool_choice"))
    if choice is not None and (tools or choice != "none"):  # any / tool: enforced by constrained decoding
        chat["tool_choice"] = choice
    output_config = body.get("output_config")
    fmt = output_config.get("format") if isinstance(output_config, Mapping) else None
    if fmt is not None:  # structured output: {"type": "json_schema", "schema": {...}}
        schema = fmt.get("schema") if isinstance(fmt, Mapping) else None
        if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema" or not isinstance(schema, Mapping):
            raise bad_request("output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}",
                              param="output_config.format")
        chat["response_format"] = parse_response_format(
            {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}},
            param="output_config.format")
    return chat


# ------------------------------------------------------------------------------------------ answers
def _stop_reason(choice: Mapping[str, Any]) -> tuple[str, str | None]:
    finish = choice["finish_reason"]
    if choice["message"].get("tool_calls"):
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    matched = choice.get("matched_stop")
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _usage(chat: Mapping[str, Any]) -> dict[str, Any]:
    """Anthropic's ``usage``: ``input_tokens`` counts the prompt tokens *not* read from the cache,
    ``cache_read_input_tokens`` those the engine's prefix cache served (their sum is the prompt)."""
    u = chat["usage"]
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's ``tool_use.input`` must be."""
    try:
        value = json.loads(arguments or "{}") if isinstance(arguments, str) else arguments
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def message_body(chat: Mapping[str, Any], message_id: str, model: str) -> dict[str, Any]:
    """The Anthropic ``message`` for a chat-completions answer."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _tool_input(call["function"]["arguments"])})
    reason, sequence = _stop_reason(choice)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(chat)}


class MessagesStream(BlockStream):
    """Anthropic's event stream of one turn, sent as the engine generates.

    ``message_start``, ``ping``; ``content_block_start`` / ``content_block_delta``
    (``thinking_delta``, ``text_delta``) / ``content_block_stop`` as reasoning and text arrive;
    after the turn one ``tool_use`` block per call (its input as one ``input_json_delta``);
    ``message_delta`` (``stop_reason``, usage) and ``message_stop``.
    """

    REASONING, TEXT = "thinking", "text"  # the content block types

    def __init__(self, request: Any) -> None:
        super().__init__(request)
        self.id = _id("msg")
        self.model = ""
        self.index = -1
        self.open_kind: str | None = None

    async def event(self, kind: str, **fields: Any) -> None:
        await self.send({"type": kind, **fields}, event=kind)

    async def start(self, *, prompt_tokens: int, model: str) -> None:
        self.model = model
        await self.open()
        await self.event("message_start", message={
            "id": self.id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0}})
        await self.event("ping")

    async def _open(self, kind: str) -> None:
        await self._close()
        self.index += 1
        self.open_kind = kind
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text",
                                                                                                 "text": ""}
        await self.event("content_block_start", index=self.index, content_block=block)

    async def _close(self) -> None:
        if self.open_kind is None:
            return
        if self.open_kind == "thinking":
            await self.event("content_block_delta", index=self.index, delta={"type": "signature_delta",
                                                                             "signature": ""})
        await self.event("content_block_stop", index=self.index)
        self.open_kind = None

    async def _piece(self, kind: str, piece: str) -> None:
        delta = {"type": "thinking_delta", "thinking": piece} if kind == "thinking" else {
            "type": "text_delta", "text": piece}
        await self.event("content_block_delta", index=self.index, delta=delta)

    async def finish(self, chat: Mapping[str, Any]) -> Any:
        await self._close()
        for call in chat["choices"][0]["message"].get("tool_calls") or []:
            self.index += 1
            await self.event("content_block_start", index=self.index, content_block={
                "type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}})
            await self.event("content_block_delta", index=self.index, delta={
                "type": "input_json_delta", "partial_json": call["function"]["arguments"] or "{}"})
            await self.event("content_block_stop", index=self.index)
        reason, sequence = _stop_reason(chat["choices"][0])
        await self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                         usage=_usage(chat))  # totals: they replace message_start's
        await self.event("message_stop")
        return await self.close()

    async def fail(self, exc: RouterError) -> Any:
        self.mark_failed(exc.status)
        await self.send(anthropic_error_body(exc), event="error")
        return await self.close()


async def handle_messages(turns: Any, request: Any) -> Any:
    """``POST /{trajectory}/{attempt}/v1/messages``."""
    turns.lookup(request)
    chat = chat_request(await read_json(request))
    stream = MessagesStream(request) if chat.get("stream") else None
    return await serve_turn(turns, request, chat, stream,
                            lambda answer: message_body(answer, _id("msg"), chat["model"]))


async def handle_count_tokens(turns: Any, request: Any) -> Any:
    """``POST /{trajectory}/{attempt}/v1/messages/count_tokens``: ``{"input_tokens": n}``."""
    turns.lookup(request)
    chat = chat_request(await read_json(request), counting=True)
    return json_response({"input_tokens": await turns.count_prompt_tokens(request, chat)})


def add_routes(app: Any, turns: Any) -> None:
    """Serve Anthropic's Messages API on every trajectory's base URL."""
    app.router.add_post("/{tid}/{attempt}/v1/messages", functools.partial(handle_messages, turns))
    app.router.add_post("/{tid}/{attempt}/v1/messages/count_tokens", functools.partial(handle_count_tokens, turns))
