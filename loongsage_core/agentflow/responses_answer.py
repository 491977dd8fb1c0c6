"""The answers of the Responses adapter: the ``response`` object and its event stream.

Both follow the OpenResponses specification (https://www.openresponses.org), which pins down the
Responses API that Codex and the ``openai`` SDK speak: every field the specification requires is
present (``completed_at``, the sampling values the turn was generated with, ``service_tier``,
``prompt_cache_key``, ...), echoed function tools carry ``strict`` (``false``: the router does not
constrain a call's arguments to its schema), and the stream is the specification's event list:
``response.created``, ``response.in_progress``, per output item ``response.output_item.added``,
``response.content_part.added``, ``response.reasoning.delta`` / ``response.output_text.delta``,
their ``.done``, ``response.content_part.done``, ``response.output_item.done``; per tool call
``response.function_call_arguments.delta`` / ``.done``; then ``response.completed`` and the
literal ``[DONE]``. A failure after the stream started is an ``error`` event followed by
``response.failed``.

A turn cut at its token limit is a response with ``status`` ``incomplete`` (its last item too),
still announced by ``response.completed``: Codex and the SDK's stream helper treat any other end
of a stream as a failed turn.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Mapping

from .errors import RouterError
from .streaming import BlockStream


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage_of(chat: Mapping[str, Any]) -> dict[str, Any]:
    """The Responses ``usage`` of a ``chat.completion`` (cached prompt tokens included)."""
    u = chat["usage"]
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def echoed_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A request's function tool as the response lists it (every field the specification requires)."""
    return {"type": "function", "name": tool["name"], "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": False}


EFFORTS = ("none", "low", "medium", "high", "xhigh")
SUMMARIES = ("concise", "detailed", "auto")


def reasoning_echo(reasoning: Any) -> dict[str, Any] | None:
    """The request's ``reasoning`` settings as the response reports them (values the
    specification does not name are reported as ``null``)."""
    if not isinstance(reasoning, Mapping):
        return None
    effort, summary = reasoning.get("effort"), reasoning.get("summary")
    return {"effort": effort if effort in EFFORTS else None, "summary": summary if summary in SUMMARIES else None}


def _string_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


class ResponseBuilder:
    """Builds the ``response`` object (and its items, with stable ids) for one turn.

    Args:
        body: the Responses request.
        model: the model name the response reports.
        used: the sampling values the turn is generated with (``temperature``, ``top_p``,
            ``presence_penalty``, ``frequency_penalty``; :func:`~.sampling.sampling_used`).
    """

    def __init__(self, body: Mapping[str, Any], model: str, used: Mapping[str, float]) -> None:
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.body = body
        self.model = model
        self.used = dict(used)
        self.ids = {"reasoning": new_id("rs"), "message": new_id("msg")}

    def reasoning_item(self, text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
        return {"type": "reasoning", "id": item_id or self.ids["reasoning"], "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if text else []}

    def message_item(self, text: str, status: str = "completed", logprobs: list[Any] | None = None,
                     item_id: str | None = None) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]
        return {"type": "message", "id": item_id or self.ids["message"], "role": "assistant", "status": status,
                "content": content if status != "in_progress" else []}

    @staticmethod
    def call_item(call: Mapping[str, Any], status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    def output(self, chat: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The output items of an answer: reasoning, message, function calls."""
        message = chat["choices"][0]["message"]
        out = []
        if message.get("reasoning_content"):
            out.append(self.reasoning_item(message["reasoning_content"]))
        if message.get("content"):
            logprobs = (chat["choices"][0].get("logprobs") or {}).get("content")
            out.append(self.message_item(message["content"], logprobs=logprobs))
        out += [self.call_item(c) for c in message.get("tool_calls") or []]
        return out

    @staticmethod
    def status_of(chat: Mapping[str, Any]) -> str:
        return "incomplete" if chat["choices"][0]["finish_reason"] == "length" else "completed"

    def response(self, chat: Mapping[str, Any] | None = None, status: str | None = None,
                 error: dict[str, Any] | None = None, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The ``response`` object: in progress (no ``chat`` yet), finished with ``chat`` (its
        ``output`` built from it unless given), or ``failed`` with ``error``."""
        body = self.body
        if chat is not None and status is None:
            status = self.status_of(chat)
        status = status or "in_progress"
        if chat is not None and output is None:
            output = self.output(chat)
        output = list(output or [])
        if status == "incomplete" and output and output[-1]["type"] != "function_call":
            output[-1] = {**output[-1], "status": "incomplete"}  # the item the token limit cut
        text: dict[str, Any] = {"format": {"type": "text"}}
        requested_text = body.get("text")
        if isinstance(requested_text, Mapping) and requested_text.get("verbosity") in ("low", "medium", "high"):
            text["verbosity"] = requested_text["verbosity"]
        reasoning = body.get("reasoning")
        max_tool_calls = body.get("max_tool_calls")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status, "model": self.model, "output": output,
            "usage": usage_of(chat) if chat is not None else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": _string_or_none(body.get("instructions")),
            "max_output_tokens": body.get("max_output_tokens"),
            "max_tool_calls": max_tool_calls if isinstance(max_tool_calls, int) else None,
            "previous_response_id": _string_or_none(body.get("previous_response_id")),
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": [echoed_tool(t) for t in body.get("tools") or []],
            "temperature": self.used["temperature"], "top_p": self.used["top_p"],
            "presence_penalty": self.used["presence_penalty"], "frequency_penalty": self.used["frequency_penalty"],
            "top_logprobs": int(body.get("top_logprobs") or 0),
            "text": text, "truncation": "disabled",
            "reasoning": reasoning_echo(reasoning),
            "metadata": body.get("metadata") if isinstance(body.get("metadata"), Mapping) else {},
            "store": True, "background": False, "service_tier": "default",
            "user": _string_or_none(body.get("user")),
            "safety_identifier": _string_or_none(body.get("safety_identifier")),
            "prompt_cache_key": _string_or_none(body.get("prompt_cache_key")),
        }


class ResponsesStream(BlockStream):
    """The Responses event stream of one turn, sent as the engine generates (see the module docstring).

    Reasoning and text open output items as they arrive (an item of a kind that comes back after
    the other opens a new item); the tool calls follow once the turn is done.
    """

    REASONING, TEXT = "reasoning", "message"  # the output item types

    def __init__(self, request: Any, builder: ResponseBuilder) -> None:
        super().__init__(request)
        self.builder = builder
        self.seq = 0
        self.index = 0
        self.open_item: tuple[str, str] | None = None  # (kind, item id)
        self.done_items: list[dict[str, Any]] = []  # the items closed so far, in order

    async def event(self, kind: str, **fields: Any) -> None:
        await self.send({"type": kind, "sequence_number": self.seq, **fields}, event=kind)
        self.seq += 1

    async def start(self, *, prompt_tokens: int, model: str) -> None:
        await self.open()
        await self.event("response.created", response=self.builder.response())
        await self.event("response.in_progress", response=self.builder.response())

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, kind: str, item_id: str, status: str, text: str = "") -> dict[str, Any]:
        b = self.builder
        if kind == "reasoning":
            return b.reasoning_item(text, status, item_id)
        return b.message_item(text, status, item_id=item_id)

    async def _open(self, kind: str) -> None:
        await self._close()
        first = all(k != kind for k, _ in self.blocks)
        item_id = self.builder.ids[kind] if first else new_id("rs" if kind == "reasoning" else "msg")
        self.open_item = (kind, item_id)
        await self.event("response.output_item.added", output_index=self.index,
                         item=self._item(kind, item_id, "in_progress"))
        await self.event("response.content_part.added", item_id=item_id, output_index=self.index,
                         content_index=0, part=self._part(kind, ""))

    async def _close(self) -> None:
        if self.open_item is None:
            return
        kind, item_id = self.open_item
        ids = {"item_id": item_id, "output_index": self.index, "content_index": 0}
        text = self.block_text
        if kind == "reasoning":
            await self.event("response.reasoning.done", text=text, **ids)
        else:
            await self.event("response.output_text.done", text=text, logprobs=[], **ids)
        await self.event("response.content_part.done", part=self._part(kind, text), **ids)
        item = self._item(kind, item_id, "completed", text)
        await self.event("response.output_item.done", output_index=self.index, item=item)
        self.done_items.append(item)
        self.open_item = None
        self.index += 1

    async def _piece(self, kind: str, piece: str) -> None:
        assert self.open_item is not None
        ids = {"item_id": self.open_item[1], "output_index": self.index, "content_index": 0}
        if kind == "reasoning":
            await self.event("response.reasoning.delta", delta=piece, **ids)
        else:
            await self.event("response.output_text.delta", delta=piece, logprobs=[], **ids)

    def _final_output(self, chat: Mapping[str, Any], calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The output ``response.completed`` reports: the items streamed when they hold the whole
        answer in another order than a plain answer's, else the answer's own items."""
        message = chat["choices"][0]["message"]
        kinds = [k for k, _ in self.blocks]
        shown = {k: "".join(t for kind, t in self.blocks if kind == k) for k in (self.REASONING, self.TEXT)}
        whole = (shown[self.REASONING] == (message.get("reasoning_content") or "")
                 and shown[self.TEXT] == (message.get("content") or ""))
        if not whole or kinds in ([], [self.REASONING], [self.TEXT], [self.REASONING, self.TEXT]):
            return self.builder.output(chat)
        return self.done_items + calls

    async def finish(self, chat: Mapping[str, Any]) -> Any:
        await self._close()
        calls = [ResponseBuilder.call_item(c) for c in chat["choices"][0]["message"].get("tool_calls") or []]
        for item in calls:
            ids = {"item_id": item["id"], "output_index": self.index}
            await self.event("response.output_item.added", output_index=self.index,
                             item={**item, "arguments": "", "status": "in_progress"})
            await self.event("response.function_call_arguments.delta", delta=item["arguments"], **ids)
            await self.event("response.function_call_arguments.done", arguments=item["arguments"], name=item["name"],
                             **ids)
            await self.event("response.output_item.done", output_index=self.index, item=item)
            self.index += 1
        await self.event("response.completed",
                         response=self.builder.response(chat, output=self._final_output(chat, calls)))
        await self.send_raw("data: [DONE]\n\n")
        return await self.close()

    async def fail(self, exc: RouterError) -> Any:
        """An error after the stream started: an ``error`` event, then ``response.failed``."""
        self.mark_failed(exc.status)
        await self._close()
        await self.event("error", error={"type": exc.type, "code": exc.code, "message": exc.message,
                                         "param": exc.param})
        error = {"code": exc.code or exc.type, "message": exc.message}
        await self.event("response.failed", response=self.builder.response(status="failed", error=error,
                                                                             output=self.done_items))
        await self.send_raw("data: [DONE]\n\n")
        return await self.close()
