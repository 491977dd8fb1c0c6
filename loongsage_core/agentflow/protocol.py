"""What every protocol adapter of the router shares: reading a body, answering JSON, serving a turn.

An adapter (:mod:`.openai_api`, :mod:`.responses_api`, :mod:`.anthropic_api`) has one shape:
``add_routes(app, turns)`` adds its routes; a handler finds the trajectory
(``turns.lookup(request)``: 404 first), reads the JSON body (:func:`read_json`), translates it into
a chat-completions body, and hands it to :func:`serve_turn` with its own stream (or none) and its
own rendering of the ``chat.completion`` answer. ``turns`` is the router's
:class:`~.turns.TurnRunner`.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any, Callable, Mapping

from .. import safe_json
from .errors import as_router_error, bad_request


def json_response(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Any:
    """An ``application/json`` response."""
    from aiohttp import web

    return web.Response(body=json.dumps(body).encode(), status=status, content_type="application/json",
                        headers=headers)


MAX_JSON_DEPTH = 64
"""Nesting levels a request body may have (real requests use a few dozen at most)."""
MAX_JSON_ITEMS = 200_000
"""Values (array elements, object members) a request body may hold."""
_PARSE_ON_LOOP_BYTES = 256 * 1024  # larger bodies are measured and parsed on a worker thread


async def read_json(request: Any) -> Any:
    """The request's JSON body; invalid JSON is a 400 ``invalid_json``, a body nested deeper than
    :data:`MAX_JSON_DEPTH` levels or holding more than :data:`MAX_JSON_ITEMS` values (measured
    before it is parsed, :mod:`loongsage_core.safe_json`) a 400 ``json_too_complex``."""
    raw = await request.read()
    parse = functools.partial(safe_json.loads, raw, max_depth=MAX_JSON_DEPTH, max_items=MAX_JSON_ITEMS)
    try:
        if len(raw) <= _PARSE_ON_LOOP_BYTES:
            return parse()
        return await asyncio.get_running_loop().run_in_executor(None, parse)
    except safe_json.JsonLimitError as exc:
        raise bad_request(f"We could not accept the JSON body of your request: {exc}.",
                          code="json_too_complex") from None
    except (ValueError, UnicodeDecodeError):
        raise bad_request("We could not parse the JSON body of your request: it is not valid JSON.",
                          code="invalid_json") from None


async def serve_turn(turns: Any, request: Any, chat: Any, stream: Any, render: Callable[[dict[str, Any]], Any],
                     on_answer: Callable[[dict[str, Any]], None] | None = None) -> Any:
    """Run the chat-completions turn ``chat`` and answer in the adapter's format.

    Without a ``stream`` the answer is ``render(chat_completion)`` as JSON. With one, the stream
    carries the turn and is finished with the answer; an error after the stream started is
    reported in the stream (before, it is an ordinary error answer). ``on_answer`` sees every
    successful answer first (e.g. to store it for a later request).
    """
    try:
        _, answer = await turns.run_turn(request, chat, stream)
    except Exception as exc:
        if stream is None or not stream.started or isinstance(exc, ConnectionResetError):
            raise
        return await stream.fail(as_router_error(exc))
    if on_answer is not None:
        on_answer(answer)
    if stream is not None:
        return await stream.finish(answer)
    return json_response(render(answer), headers=turn_headers(request))


def turn_headers(request: Any) -> dict[str, str]:
    """Headers of a turn's answer: how many tokens it was allowed to generate (a request's limit
    above what the trajectory may still generate is lowered to that, and said so here)."""
    from ._request_keys import MAX_NEW_TOKENS, MAX_NEW_TOKENS_HEADER

    allowed = request.get(MAX_NEW_TOKENS)
    return {} if allowed is None else {MAX_NEW_TOKENS_HEADER: str(allowed)}
