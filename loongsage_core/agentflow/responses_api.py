"""OpenAI's Responses API (``POST .../v1/responses``, what Codex speaks) as a thin adapter.

A request is translated into one chat-completions turn of the trajectory (so tokens, loss masks
and segments are recorded exactly as for any other protocol) and the answer back into a
``response`` object, or into the Responses event stream while the engine generates.

Translation: ``instructions`` become the system message; ``input`` (a string, or items) becomes
messages: ``message`` items keep their role (``input_text`` / ``output_text`` parts), a
``function_call`` joins the assistant message before it as a tool call (``call_id`` is the tool
call id), a ``function_call_output`` becomes a ``tool`` message, and a ``reasoning`` item becomes
the next assistant message's ``reasoning_content``. ``previous_response_id`` prepends the input
and output of a response this trajectory produced earlier (kept per trajectory). Function tools
map to chat tools; other tool types and other input items are a clear 400. The answer's
``reasoning_content``, ``content`` and ``tool_calls`` become ``reasoning``, ``message`` and
``function_call`` output items, in the ``response`` object and event stream of
:mod:`.responses_answer` (the OpenResponses specification). ``tool_choice`` ``required`` or a named
function and a ``text.format`` of ``json_object`` / ``json_schema`` are enforced by constrained decoding.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Mapping

from .errors import bad_request
from .openai_api import MAX_TOKENS_LIMIT, parse_chat_request, parse_response_format, parse_tools, shown
from .protocol import read_json, serve_turn
from .responses_answer import ResponseBuilder, ResponsesStream
from .sampling import sampling_used

PROTOCOL = "responses"

# Request fields the adapter translates.
_SUPPORTED = {"input", "instructions", "model", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
              "presence_penalty", "frequency_penalty", "top_logprobs", "previous_response_id", "stream", "text",
              "reasoning"}
# Accepted without effect on generation (provider bookkeeping; Codex sends several).
_IGNORED = {"include", "metadata", "parallel_tool_calls", "prompt_cache_key", "prompt_cache_retention",
            "prompt_cache_options", "safety_identifier", "service_tier", "store", "user", "stream_options",
            "max_tool_calls", "truncation", "client_metadata"}
# Accepted only at their neutral value.
_NEUTRAL = {"background": lambda v: v in (None, False), "conversation": lambda v: v is None,
            "prompt": lambda v: v is None, "context_management": lambda v: v is None}
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")


def _text(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param=param, code="invalid_type")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind not in kinds:
            raise bad_request(f"{param}[{j}]: content parts of type {json.dumps(kind)} are not supported "
                              f"(supported: {', '.join(kinds)})", param=f"{param}[{j}].type",
                              code="unsupported_content")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{param}[{j}].text must be a string", param=f"{param}[{j}].text", code="invalid_type")
        out.append(part["text"])
    return "".join(out)


def _parts_with_images(parts: list[Any], param: str) -> list[dict[str, Any]]:
    """A user message's ``input_text`` and ``input_image`` parts as chat-completions ``text`` and
    ``image_url`` parts; an image must be an inline data URL (``file_id`` and remote URLs are refused)."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if part.get("type") == "input_image":
            if part.get("file_id") is not None:
                raise bad_request(f"{param}[{j}].file_id: uploaded files are not supported; send the image as a "
                                  "base64 data URL in 'image_url'", param=f"{param}[{j}].file_id",
                                  code="unsupported_content")
            if not isinstance(part.get("image_url"), str):
                raise bad_request(f"{param}[{j}].image_url must be a data URL string", param=f"{param}[{j}].image_url",
                                  code="invalid_type")
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            out.append({"type": "text", "text": _text([part], f"{param}[{j}]", ("input_text", "text"))})
    return out


def _reasoning_text(item: Mapping[str, Any], param: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise bad_request(f"{param}.content must be a list", param=f"{param}.content", code="invalid_type")
    return _text(parts, f"{param}.content", ("reasoning_text", "summary_text", "text"))


def input_messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages for a Responses ``input`` (a string or a list of items)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request("'input' must be a string or a list of input items", param="input", code="invalid_type")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None

    def assistant() -> dict[str, Any]:
        """The assistant message a function call or reasoning belongs to (opened when needed)."""
        nonlocal reasoning
        if not messages or messages[-1]["role"] != "assistant" or messages[-1].get("_closed"):
            messages.append({"role": "assistant", "content": None})
        if reasoning is not None:
            messages[-1]["reasoning_content"] = reasoning
            reasoning = None
        return messages[-1]

    for i, item in enumerate(value):
        p = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise bad_request(f"{p} must be an object", param=p, code="invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise bad_request(f"{p}.role must be one of {', '.join(_MESSAGE_ROLES)}, got {json.dumps(role)}",
                                  param=f"{p}.role", code="invalid_value")
            kinds = ("output_text", "refusal", "input_text") if role == "assistant" else ("input_text", "text")
            if role == "assistant":
                content = item.get("content")
                if isinstance(content, list):  # a refusal part carries its text as "refusal"
                    content = [{**c, "text": c["refusal"]} if isinstance(c, Mapping) and c.get("type") == "refusal"
                               else c for c in content]
                text = _text(content, f"{p}.content", kinds)
                msg = assistant()
                msg["content"] = (msg["content"] or "") + text
                if msg.get("tool_calls"):
                    msg["_closed"] = True
            elif role == "user" and isinstance(item.get("content"), list) and any(
                    isinstance(c, Mapping) and c.get("type") == "input_image" for c in item["content"]):
                messages.append({"role": role, "content": _parts_with_images(item["content"], f"{p}.content")})
            else:
                messages.append({"role": role, "content": _text(item.get("content"), f"{p}.content", kinds)})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{p}.{key} must be a string", param=f"{p}.{key}", code="invalid_value")
            assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{p}.call_id must be a string", param=f"{p}.call_id", code="invalid_value")
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["_closed"] = True
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{p}.output", ("input_text", "output_text"))})
        elif kind == "reasoning":
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["_closed"] = True
            reasoning = _reasoning_text(item, p)
        else:
            raise bad_request(f"{p}: input items of type {json.dumps(kind)} are not supported (supported: message, "
                              "function_call, function_call_output, reasoning)", param=f"{p}.type",
                              code="unsupported_value")
    for msg in messages:
        msg.pop("_closed", None)
    return messages


def function_of(tool: Any, param: str) -> dict[str, Any]:
    """The chat-completions function of one Responses tool (``{"type": "function", "name", ...}``)."""
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    if kind != "function":
        raise bad_request(f"{param}: tools of type {json.dumps(kind)} are not supported; only 'function' tools are",
                          param=f"{param}.type", code="unsupported_value")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad_request(f"{param}.name is required", param=f"{param}.name", code="invalid_value")
    return {"name": tool["name"], **{key: tool[key] for key in ("description", "parameters")
                                     if tool.get(key) is not None}}


def chat_tool_choice(value: Any) -> Any:
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}",
                      param="tool_choice", code="unsupported_value")


def chat_response_format(fmt: Any) -> dict[str, Any] | None:
    """The chat ``response_format`` of a Responses ``text.format`` (``text``, ``json_object`` or
    ``json_schema`` with ``name``/``schema``/``strict`` beside ``type``); ``None`` for text."""
    if fmt is None:
        return None
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return parse_response_format({"type": "json_schema", "json_schema": spec}, param="text.format")
    return parse_response_format(fmt, param="text.format")


def chat_request(body: Any, history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat-completions body for a Responses request, and its conversation without instructions."""
    if not isinstance(body, Mapping):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    for key in body:
        if key not in _SUPPORTED and key not in _IGNORED and key not in _NEUTRAL:
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    for key, neutral in _NEUTRAL.items():
        if key in body and not neutral(body[key]):
            raise bad_request(f"'{key}' is not supported by this endpoint", param=key, code="unsupported_parameter")
    if "input" not in body:
        raise bad_request("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    text = body.get("text")
    if text is not None and not isinstance(text, Mapping):
        raise bad_request("'text' must be an object", param="text", code="invalid_type")
    response_format = chat_response_format(text.get("format") if text else None)
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, Mapping) or any(
            reasoning.get(key) is not None and not isinstance(reasoning[key], str) for key in ("effort", "summary"))):
        raise bad_request("'reasoning' must be an object with string 'effort' and 'summary'", param="reasoning",
                          code="invalid_type")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", param="instructions", code="invalid_type")
    conversation = history + input_messages(body["input"])
    chat: dict[str, Any] = {"messages": ([{"role": "system", "content": instructions}] if instructions else [])
                            + conversation}
    for key in ("model", "temperature", "top_p", "presence_penalty", "frequency_penalty", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_TOKENS_LIMIT:
            raise bad_request(f"'max_output_tokens' must be an integer in [1, {MAX_TOKENS_LIMIT}], got {shown(limit)}",
                              param="max_output_tokens", code="invalid_value")
        chat["max_tokens"] = limit
    if body.get("top_logprobs"):
        chat["logprobs"], chat["top_logprobs"] = True, body["top_logprobs"]
    tools = parse_tools(body.get("tools"), function_of)
    if tools:
        chat["tools"] = tools
    choice = chat_tool_choice(body.get("tool_choice"))
    if choice is not None:  # required / a named function: enforced by constrained decoding
        chat["tool_choice"] = choice
    if response_format is not None:
        chat["response_format"] = response_format
    return chat, conversation


async def handle_responses(turns: Any, request: Any) -> Any:
    """``POST /{trajectory}/{attempt}/v1/responses``."""
    turns.lookup(request)
    body = await read_json(request)
    store = turns.protocol_state(request, PROTOCOL)
    previous = body.get("previous_response_id") if isinstance(body, Mapping) else None
    history: list[dict[str, Any]] = []
    if previous is not None:
        if not isinstance(previous, str):
            raise bad_request("'previous_response_id' must be a string", param="previous_response_id",
                              code="invalid_type")
        if previous not in store:
            raise bad_request(f"Previous response with id '{previous}' not found.", param="previous_response_id",
                              code="previous_response_not_found")
        history = [dict(m) for m in store[previous]]
    chat, conversation = chat_request(body, history)
    used = sampling_used(turns.lookup(request).sampling, parse_chat_request(chat))
    builder = ResponseBuilder(body, chat.get("model") or turns.model_name, used)
    stream = ResponsesStream(request, builder) if chat.get("stream") else None

    def remember(answer: dict[str, Any]) -> None:
        store[builder.id] = conversation + [dict(answer["choices"][0]["message"])]

    return await serve_turn(turns, request, chat, stream, builder.response, on_answer=remember)


def add_routes(app: Any, turns: Any) -> None:
    """Serve the Responses API on every trajectory's base URL."""
    app.router.add_post("/{tid}/{attempt}/v1/responses", functools.partial(handle_responses, turns))
