"""Turning a generation in progress into the text increments every protocol streams.

The engine streams token ids as they are generated. What an agent may see of them is not the raw
text: stop strings end the content, and response middleware (tool-call and reasoning parsers)
rewrites the final message. :class:`TextStreamer` computes, after every engine update, the
``content`` and ``reasoning_content`` that are already certain and hands out what is new.

Certainty comes from *hold-back*: the trailing characters that a stop string or a middleware may
still claim are kept until more text arrives. A middleware takes part in streaming by defining
``stream_holdback(request, text) -> int`` (how many trailing characters of the partial ``text`` it
cannot judge yet, in the text as it receives it: the content the middleware before it in the chain
made of the partial text, which is the tail of that text); it thereby declares that its
``on_response`` is a pure function of the response that may also run on a partial one
(``finish_reason`` ``None``): the contract's ``StreamingMiddleware`` capability. A middleware that
never changes responses (a logger) says so with ``changes_response = False`` (the
``ObservingMiddleware`` capability) and is left out of partial views. While any other middleware
lacks ``stream_holdback``, nothing is streamed before the turn ends (the safe default).

Increments are append-only, so every middleware that streams must be *prefix-stable*: the
message it makes of a longer text extends the one it made of a shorter text, but for trailing
white space (parsers strip around what they take out, so white space at the end of a partial
view waits for what follows). The parsers of loongsage-plugin-agents are; if a middleware is not
(a later view no longer extends what was sent), that field stops streaming with a warning and the
rest of it is never resent.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any, Callable, Mapping, Sequence

from loongsage_hookspecs import ObservingMiddleware, StreamingMiddleware

log = logging.getLogger(__name__)


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of ``text`` that could be the start of a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if stop.startswith(text[-n:]):
                hold = n
                break
    return hold


def changes_responses(middleware: Any) -> bool:
    """Whether ``middleware`` may change a response: all do but an ``ObservingMiddleware`` that
    declares ``changes_response = False`` (a logger), which partial views leave out."""
    return not (isinstance(middleware, ObservingMiddleware) and middleware.changes_response is False)


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """``text`` up to the first stop string, and that stop string (``None`` when none occurs)."""
    hits = sorted((at, s) for s in stops if (at := text.find(s)) >= 0)
    return (text[:hits[0][0]], hits[0][1]) if hits else (text, None)


def held_from(text: str, held: str) -> int:
    """Where in ``text`` the piece ``held`` of a middleware's view starts (everything from there
    waits): the view is the tail of the text, less white space a parser stripped around it, so
    ``held`` is found last in the text; a view that is no substring of it holds the whole text."""
    at = text.rfind(held)
    return at if at >= 0 else 0


class TextStreamer:
    """Incremental ``content`` / ``reasoning_content`` of one turn (see the module docstring).

    Args:
        decode: the text of generated token ids (without the final turn-end token).
        middlewares: the router's response middleware, in order.
        trajectory_id, request: what ``on_response`` is called with.
        stops: the request's stop strings (the content ends before the first one).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], middlewares: Sequence[Any], trajectory_id: str,
                 request: Mapping[str, Any], stops: Sequence[str]) -> None:
        self.decode = decode
        self.middlewares = [mw for mw in middlewares if changes_responses(mw)]
        self.trajectory_id = trajectory_id
        self.request = request
        self.stops = list(stops)
        self.live = all(isinstance(mw, StreamingMiddleware) for mw in self.middlewares)
        self.sent = {"content": "", "reasoning_content": ""}
        self.broken: set[str] = set()

    def _view(self, text: str, through: int | None = None) -> dict[str, Any]:
        """The partial message the first ``through`` middlewares (default: all) make of ``text``."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        response: Any = {"choices": [{"index": 0, "message": message, "finish_reason": None}]}
        for mw in self.middlewares[:through]:
            response = mw.on_response(self.trajectory_id, copy.deepcopy(self.request), response)
        return response["choices"][0]["message"]

    def _increments(self, message: Mapping[str, Any], final: bool) -> dict[str, str]:
        out = {}
        for field in ("reasoning_content", "content"):
            value = message.get(field)
            if not isinstance(value, str) or field in self.broken:
                continue
            if self.middlewares and not final:  # white space at the end may still be taken out
                value = value.rstrip()
            sent = self.sent[field]
            if not value.startswith(sent):
                log.warning("AgentFlow streaming: %s of trajectory %s changed after it was streamed; the rest "
                            "of it is not streamed", field, self.trajectory_id)
                self.broken.add(field)
                continue
            if len(value) > len(sent):
                out[field] = value[len(sent):]
                self.sent[field] = value
        return out

    def update(self, generated: Sequence[int]) -> dict[str, str]:
        """New certain text after the engine reported ``generated`` (all tokens of the turn so far)."""
        if not self.live or not generated:
            return {}
        # a trailing replacement character is an incomplete UTF-8 sequence: wait for its other bytes
        text, stopped = cut_at_stop(self.decode(generated).rstrip("\ufffd"), self.stops)
        if stopped is None:
            text = text[:len(text) - stop_holdback(text, self.stops)]
        for i, mw in enumerate(self.middlewares):
            # each judges the content the middleware before it made, as its on_response will see it
            seen = text if i == 0 else self._view(text, i).get("content")
            seen = seen if isinstance(seen, str) else ""
            hold = min(int(mw.stream_holdback(self.request, seen)), len(seen))
            if hold > 0:
                text = text[:held_from(text, seen[len(seen) - hold:])]
        if not text:
            return {}
        return self._increments(self._view(text), final=False)

    def finish(self, message: Mapping[str, Any]) -> dict[str, str]:
        """What is left to send of the final ``message`` (after the real ``on_response`` ran)."""
        return self._increments(message, final=True)


class SSEStream:
    """A server-sent-events answer that opens only when the turn is accepted.

    Until :meth:`open` nothing is sent, so a request refused before generation gets an ordinary
    JSON error with its status; after it, protocols report failures as an error event.
    """

    def __init__(self, request: Any) -> None:
        self.request = request
        self.response: Any = None
        self.started = False

    async def open(self) -> None:
        from aiohttp import web

        from .protocol import turn_headers

        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
            **turn_headers(self.request)})
        await self.response.prepare(self.request)
        self.started = True

    async def send(self, data: Any, event: str | None = None) -> None:
        """One event: ``event: NAME`` (when given) and ``data: JSON``."""
        head = f"event: {event}\n" if event else ""
        await self.response.write((head + "data: " + json.dumps(data) + "\n\n").encode())

    async def send_raw(self, text: str) -> None:
        await self.response.write(text.encode())

    async def close(self) -> Any:
        await self.response.write_eof()
        return self.response

    def mark_failed(self, status: int) -> None:
        """Let the access log show the error a stream reported after its 200 header."""
        from ._request_keys import STATUS

        self.request[STATUS] = status


class BlockStream(SSEStream):
    """A stream that shows a turn as blocks of reasoning and of text, as they are generated
    (Anthropic's content blocks, the Responses API's output items).

    A new block opens whenever the kind of text changes, so reasoning that comes after the answer
    started opens a reasoning block of its own and the text of each kind adds up to the turn's.
    Subclasses name the two kinds (:attr:`REASONING`, :attr:`TEXT`) and say how a block opens
    (``_open(kind)``, which closes the open one) and how a piece of one is sent (``_piece``).
    """

    REASONING = "reasoning"
    TEXT = "text"

    def __init__(self, request: Any) -> None:
        super().__init__(request)
        self.blocks: list[list[str]] = []  # [kind, text] of every block shown, in order

    @property
    def block_text(self) -> str:
        """The text the open (last) block has shown."""
        return self.blocks[-1][1] if self.blocks else ""

    async def _open(self, kind: str) -> None:
        raise NotImplementedError

    async def _piece(self, kind: str, piece: str) -> None:
        raise NotImplementedError

    async def delta(self, increments: Mapping[str, str]) -> None:
        for field, kind in (("reasoning_content", self.REASONING), ("content", self.TEXT)):
            piece = increments.get(field)
            if not piece:
                continue
            if not self.blocks or self.blocks[-1][0] != kind:
                await self._open(kind)
                self.blocks.append([kind, ""])
            self.blocks[-1][1] += piece
            await self._piece(kind, piece)
