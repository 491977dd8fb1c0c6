"""The OpenAI chat-completions surface of the router: request validation and response shapes.

:func:`parse_chat_request` checks a request body the way the OpenAI API does (unknown fields,
wrong types and unsupported values are 400 errors naming the parameter) and turns it into a
:class:`ChatRequest`; :func:`completion_body` builds the
``chat.completion`` object; :class:`ChatCompletionStream` streams a turn as ``chat.completion.chunk``
events while it is generated.
"""

from __future__ import annotations

import functools
import json
import math
import time
import uuid
from typing import Any, Callable, Mapping

import attrs

from .errors import RouterError, bad_request
from .images import image_url_of
from .protocol import json_response, read_json, serve_turn
from .streaming import SSEStream

# Fields of OpenAI's chat-completions request that the router honours.
_SUPPORTED = {
    "messages", "model", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "max_tokens", "max_completion_tokens", "seed", "logprobs", "top_logprobs", "tools",
    "tool_choice", "presence_penalty", "frequency_penalty", "response_format",
}
# OpenAI fields accepted but without effect on generation (bookkeeping for the provider side).
_IGNORED = {
    "user", "metadata", "store", "parallel_tool_calls", "service_tier", "prompt_cache_key",
    "safety_identifier", "reasoning_effort", "verbosity",
}
# OpenAI fields accepted only at their neutral value; anything else cannot be honoured.
_NEUTRAL = {
    "logit_bias": lambda v: v is None or v == {},
    "modalities": lambda v: v is None or v == ["text"],
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "functions": lambda v: v is None,
    "function_call": lambda v: v is None,
}
# Extensions common to SGLang / vLLM OpenAI servers.
_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "chat_template_kwargs", "continue_final_message"}

KNOWN_FIELDS = frozenset(_SUPPORTED | _IGNORED | set(_NEUTRAL) | _EXTENSIONS)
"""Every request field the router accepts; anything else is rejected with a 400."""

ROLES = ("system", "developer", "user", "assistant", "tool")


@attrs.define
class ChatRequest:
    """A validated chat-completions request (OpenAI names; ``None`` means "not given")."""

    messages: list[dict[str, Any]]
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None
    stop: list[str] = attrs.field(factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    """``None``, ``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name"}}``
    (the last two are enforced by constrained decoding, :mod:`.constraints`)."""
    response_format: dict[str, Any] | None = None
    """``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name", "schema"}}``
    (enforced by constrained decoding); ``None`` for plain text."""
    chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    continue_final_message: bool = False
    """The last message is an assistant prefill the model continues (vLLM's extension; what an
    Anthropic request ending with an assistant message means)."""

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt offers the model: none with ``tool_choice`` ``"none"``."""
        return None if self.tool_choice == "none" else self.tools


MAX_TOKENS_LIMIT = 2**31 - 1
"""The largest token limit a request may ask for (a smaller one beyond what the trajectory may still
generate is lowered to that: see :func:`~.sampling.max_new_tokens`)."""


def shown(value: Any) -> str:
    """A request value in an error message: JSON, a huge number by its first digits."""
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _number(body: Mapping[str, Any], key: str, lo: float | None = None, hi: float | None = None,
            integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return None
    ok_types = (int,) if integer else (int, float)
    bad_float = isinstance(value, float) and not math.isfinite(value)
    if isinstance(value, bool) or not isinstance(value, ok_types) or bad_float:
        kind = "an integer" if integer else "a number"
        raise bad_request(f"'{key}' must be {kind}, got {shown(value)}", param=key, code="invalid_type")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise bad_request(f"'{key}' must be in {bounds}, got {shown(value)}", param=key, code="invalid_value")
    return value


def _bool(body: Mapping[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean, got {json.dumps(value)}", param=key, code="invalid_type")
    return value


def _text_content(content: Any, param: str, images: bool = False) -> str | list[dict[str, Any]] | None:
    """Plain text of a message ``content`` (a string, ``None`` or a list of text parts). With
    ``images`` (user and tool messages), ``image_url`` parts are allowed too, and content that has
    one stays a list of ``text`` and ``image_url`` parts (the router resolves the images:
    :class:`~.images.ImageInputs`)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if images and kind == "image_url":
                parts.append({"type": "image_url", "image_url": {"url": image_url_of(part, f"{param}[{j}]")}})
                continue
            if kind not in ("text", "input_text"):
                allowed = "text and image_url" if images else "text"
                raise bad_request(f"{param}[{j}]: only {allowed} content parts are supported, got '{kind}'",
                                  param=f"{param}[{j}]", code="unsupported_content")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{param}[{j}].text must be a string", param=f"{param}[{j}].text",
                                  code="invalid_type")
            parts.append({"type": "text", "text": text})
        if any(p["type"] == "image_url" for p in parts):
            return parts
        return "".join(p["text"] for p in parts)
    raise bad_request(f"{param} must be a string or a list of content parts", param=param, code="invalid_type")


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"{param} must be a list", param=param, code="invalid_type")
    out = []
    for j, call in enumerate(calls):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{p}.function.name is required", param=f"{p}.function.name", code="invalid_value")
        args = fn.get("arguments", "")
        if not isinstance(args, (str, Mapping)):
            raise bad_request(f"{p}.function.arguments must be a JSON string", param=f"{p}.function.arguments",
                              code="invalid_type")
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated messages in a uniform shape: text content, OpenAI ``tool_calls``."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages", code="invalid_value")
    out = []
    for i, msg in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise bad_request(f"{p} must be an object", param=p, code="invalid_type")
        role = msg.get("role")
        if role not in ROLES:
            raise bad_request(f"{p}.role must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
                              param=f"{p}.role", code="invalid_value")
        clean: dict[str, Any] = {"role": role, "content": _text_content(msg.get("content"), f"{p}.content",
                                                                        images=role in ("user", "tool"))}
        if role == "assistant":
            if msg.get("tool_calls"):
                clean["tool_calls"] = _tool_calls(msg["tool_calls"], f"{p}.tool_calls")
            reasoning = msg.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                clean["reasoning_content"] = reasoning
        elif clean["content"] is None:
            raise bad_request(f"{p}.content is required for role '{role}'", param=f"{p}.content",
                              code="invalid_value")
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{p}.tool_call_id is required for role 'tool'", param=f"{p}.tool_call_id",
                                  code="invalid_value")
            clean["tool_call_id"] = call_id
        if isinstance(msg.get("name"), str):
            clean["name"] = msg["name"]
        out.append(clean)
    return out


def chat_function(tool: Any, param: str) -> dict[str, Any]:
    """The ``function`` of one chat-completions tool (``{"type": "function", "function": {...}}``)."""
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise bad_request(f"{param}: only tools of type 'function' are supported", param=param, code="invalid_value")
    fn = tool.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"{param}.function.name is required", param=f"{param}.function.name", code="invalid_value")
    if "parameters" in fn and not isinstance(fn["parameters"], Mapping):
        raise bad_request(f"{param}.function.parameters must be a JSON schema object",
                          param=f"{param}.function.parameters", code="invalid_type")
    return dict(fn)


def parse_tools(tools: Any, function_of: Callable[[Any, str], dict[str, Any]] = chat_function
                ) -> list[dict[str, Any]] | None:
    """Chat-completions tools from a request's ``tools`` list (``None`` when there are none).

    ``function_of(tool, param)`` reads one tool as its protocol spells it into the function
    object (``name``, ``description``, ``parameters``) or raises a 400 naming ``param``.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", param="tools", code="invalid_type")
    return [{"type": "function", "function": function_of(tool, f"tools[{i}]")} for i, tool in enumerate(tools)] \
        or None


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> Any:
    """``none`` / ``auto`` / ``required`` / a named function (one of ``tools``); the last two are
    enforced by constrained decoding (:mod:`.constraints`)."""
    if value is None or value in ("auto", "none"):
        return value
    if value == "required" or (isinstance(value, Mapping) and isinstance(value.get("function"), Mapping)):
        if value != "required":
            name = value["function"].get("name")
            if name not in {t["function"]["name"] for t in tools or []}:
                raise bad_request(f"tool_choice names function {shown(name)}, which is not in 'tools'",
                                  param="tool_choice", code="invalid_value")
            return {"type": "function", "function": {"name": name}}
        if not tools:
            raise bad_request("tool_choice 'required' needs 'tools'", param="tool_choice", code="invalid_value")
        return value
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", ...}",
                      param="tool_choice", code="invalid_value")


def parse_response_format(value: Any, param: str = "response_format") -> dict[str, Any] | None:
    """A chat ``response_format``: ``None`` for text, else ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"name", "schema"[, "strict", "description"]}}``
    (a 400 naming ``param`` for anything else)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad_request(f"'{param}.type' must be 'text', 'json_object' or 'json_schema', got "
                          f"{shown(kind)}", param=f"{param}.type", code="invalid_value")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_request(f"'{param}.json_schema.name' is required", param=f"{param}.json_schema.name",
                          code="missing_required_parameter")
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, Mapping):
        raise bad_request(f"'{param}.json_schema.schema' must be a JSON schema object",
                          param=f"{param}.json_schema.schema", code="invalid_type")
    return {"type": "json_schema", "json_schema": dict(spec)}


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a chat-completions request body; raise a 400 :class:`RouterError` naming the field."""
    if not isinstance(body, Mapping):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    for key in body:
        if key not in KNOWN_FIELDS:
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key,
                              code="unknown_parameter")
    for key, neutral in _NEUTRAL.items():
        if key in body and not neutral(body[key]):
            raise bad_request(f"'{key}' is not supported by this endpoint", param=key, code="unsupported_parameter")
    n = _number(body, "n", lo=1, integer=True)
    if n not in (None, 1):
        raise bad_request("only n=1 is supported; sample several trajectories instead", param="n",
                          code="unsupported_value")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model", code="invalid_type")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad_request("'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if any(not s for s in stops):
        raise bad_request("'stop' strings must be non-empty", param="stop", code="invalid_value")
    max_tokens = _number(body, "max_completion_tokens", lo=1, hi=MAX_TOKENS_LIMIT, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", lo=1, hi=MAX_TOKENS_LIMIT, integer=True)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, Mapping):
        raise bad_request("'stream_options' must be an object", param="stream_options", code="invalid_type")
    stream = bool(_bool(body, "stream"))
    include_usage = bool(stream_options and stream_options.get("include_usage"))
    logprobs = bool(_bool(body, "logprobs"))
    top_logprobs = _number(body, "top_logprobs", lo=0, hi=20, integer=True) or 0
    if top_logprobs and not logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs", code="invalid_value")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise bad_request("'chat_template_kwargs' must be an object", param="chat_template_kwargs",
                          code="invalid_type")
    tools = parse_tools(body.get("tools"))
    messages = parse_messages(body.get("messages"))
    continue_final = bool(_bool(body, "continue_final_message"))
    if continue_final and (messages[-1]["role"] != "assistant" or messages[-1].get("tool_calls")):
        raise bad_request("'continue_final_message' needs a final assistant message with text only (a prefill)",
                          param="continue_final_message", code="invalid_value")
    return ChatRequest(
        messages=messages,
        model=model,
        temperature=_number(body, "temperature", lo=0, hi=2),
        top_p=_number(body, "top_p", lo=0, hi=1),
        top_k=_number(body, "top_k", lo=-1, hi=2**31 - 1, integer=True),
        min_p=_number(body, "min_p", lo=0, hi=1),
        repetition_penalty=_number(body, "repetition_penalty", lo=0),
        presence_penalty=_number(body, "presence_penalty", lo=-2, hi=2),
        frequency_penalty=_number(body, "frequency_penalty", lo=-2, hi=2),
        max_tokens=max_tokens,
        stop=stops,
        seed=_number(body, "seed", lo=-(2**63), hi=2**63 - 1, integer=True),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        response_format=parse_response_format(body.get("response_format")),
        chat_template_kwargs=dict(kwargs or {}),
        continue_final_message=continue_final,
    )


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


def new_completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def completion_body(*, completion_id: str, model: str, message: dict[str, Any], finish_reason: str,
                    prompt_tokens: int, completion_tokens: int, logprobs: dict[str, Any] | None = None,
                    extra: dict[str, Any] | None = None, created: int | None = None,
                    cached_tokens: int = 0) -> dict[str, Any]:
    """A ``chat.completion`` object with one choice and ``usage`` (``cached_tokens``: prompt tokens
    the engine's prefix cache served, ``usage.prompt_tokens_details.cached_tokens``)."""
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": cached_tokens}},
    }
    if extra:
        body.update(extra)
    return body


class ChatCompletionStream(SSEStream):
    """Streams one turn as ``chat.completion.chunk`` events while the engine generates.

    Order, as OpenAI sends it: the role, then reasoning and content pieces as they are generated,
    one chunk per tool call once the turn ended, the finish reason (with the turn's log-probs when
    asked), a usage chunk with empty ``choices`` when ``stream_options.include_usage``, ``[DONE]``.
    """

    def __init__(self, request: Any, body: Mapping[str, Any]) -> None:
        super().__init__(request)
        options = body.get("stream_options")
        self.include_usage = bool(isinstance(options, Mapping) and options.get("include_usage"))
        self.head: dict[str, Any] = {"id": new_completion_id(), "object": "chat.completion.chunk",
                                     "created": int(time.time()), "model": ""}

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {**self.head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    async def start(self, *, prompt_tokens: int, model: str) -> None:
        self.head["model"] = model
        await self.open()
        await self.send(self._chunk({"role": "assistant", "content": ""}))

    async def delta(self, increments: Mapping[str, str]) -> None:
        if increments.get("reasoning_content"):
            await self.send(self._chunk({"reasoning_content": increments["reasoning_content"]}))
        if increments.get("content"):
            await self.send(self._chunk({"content": increments["content"]}))

    async def finish(self, body: Mapping[str, Any]) -> Any:
        choice = body["choices"][0]
        for i, call in enumerate(choice["message"].get("tool_calls") or []):
            await self.send(self._chunk({"tool_calls": [{
                "index": i, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}}]}))
        await self.send(self._chunk({}, finish=choice["finish_reason"], logprobs=choice.get("logprobs")))
        if self.include_usage:
            await self.send({**self.head, "choices": [], "usage": body["usage"]})
        await self.send_raw("data: [DONE]\n\n")
        return await self.close()

    async def fail(self, exc: RouterError) -> Any:
        """An error after the stream started: an ``{"error": ...}`` event (the SDKs raise it)."""
        self.mark_failed(exc.status)
        await self.send(exc.body())
        await self.send_raw("data: [DONE]\n\n")
        return await self.close()


async def handle_chat(turns: Any, request: Any) -> Any:
    """``POST /{trajectory}/{attempt}/v1/chat/completions``."""
    turns.lookup(request)
    body = await read_json(request)
    parse_chat_request(body)  # a stream starts only for a valid request
    stream = ChatCompletionStream(request, body) if isinstance(body, dict) and body.get("stream") else None
    return await serve_turn(turns, request, body, stream, lambda answer: answer)


def model_object(request: Any, model_id: str) -> dict[str, Any]:
    """One model as the protocol of ``request`` lists it: Anthropic's shape when the request
    carries an ``anthropic-version`` header, else OpenAI's."""
    if "anthropic-version" in request.headers:
        return {"type": "model", "id": model_id, "display_name": model_id, "created_at": "1970-01-01T00:00:00Z"}
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "loongsage"}


async def handle_models(turns: Any, request: Any) -> Any:
    """``GET /{trajectory}/{attempt}/v1/models``: the one model the router serves."""
    turns.lookup(request)
    model = model_object(request, turns.model_name)
    if "anthropic-version" in request.headers:
        return json_response({"data": [model], "has_more": False, "first_id": model["id"], "last_id": model["id"]})
    return json_response({"object": "list", "data": [model]})


async def handle_model(turns: Any, request: Any) -> Any:
    """``GET /{trajectory}/{attempt}/v1/models/{model}``: the router serves every model name
    with the policy (requests may name any model), so any name is answered."""
    turns.lookup(request)
    return json_response(model_object(request, request.match_info["model"]))


def add_routes(app: Any, turns: Any) -> None:
    """Serve OpenAI's Chat Completions API (and the model list) on every trajectory's base URL."""
    app.router.add_post("/{tid}/{attempt}/v1/chat/completions", functools.partial(handle_chat, turns))
    app.router.add_get("/{tid}/{attempt}/v1/models", functools.partial(handle_models, turns))
    app.router.add_get("/{tid}/{attempt}/v1/models/{model:.+}", functools.partial(handle_model, turns))
