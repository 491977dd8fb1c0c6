"""What the embedded engine's HTTP endpoint modules share: the engine they serve, the way they
run code on its loop, and JSON in and out.

:class:`ServedEngine` is the shape of engine the endpoints need; :class:`EngineEndpoints` the
base of the endpoint mixins (:mod:`.weight_endpoints`) and of :class:`~.server.EngineServer`;
:func:`read_json_body` and :func:`error_response` read a request body and write an error body.
Kept in one place so that the server and its endpoint modules depend on it and not on each other.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol

from aiohttp import web

from .request_checks import InvalidRequest
from .settings import EngineSettings

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .runner import ModelRunner
    from .scheduler import Scheduler


def error_response(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    """An error answer in SGLang's shape: ``{"error": {"message", "type", "param"}}``."""
    return web.json_response({"error": {"message": message, "type": kind, "param": param}}, status=status)


async def read_json_body(request: web.Request) -> Any:
    """The request's JSON body, ``None`` when it has none; malformed JSON is an :class:`InvalidRequest`."""
    if not request.can_read_body:
        return None
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


class ServedEngine(Protocol):
    """What the HTTP server needs of the engine it serves (:class:`~.engine.EmbeddedEngine` is one).

    Declared here so that the server depends on this shape only, and the engine on the server.
    """

    settings: EngineSettings
    scheduler: Scheduler
    runner: ModelRunner
    model: Any
    tokenizer: Any
    vocab_size: int
    model_path: str | None
    tokenizer_path: str | None
    vision: Any  # a vision-language model's image preprocessing (.vision), else None

    @property
    def weight_groups(self) -> Any: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...

    def load_formats(self) -> list[str]: ...

    def named_tensors_from(self, load_format: str,
                           payload: Mapping[str, Any]) -> Iterator[tuple[str, "torch.Tensor"]]: ...


class EngineEndpoints:
    """Base of the HTTP endpoint classes: the engine they serve, and :meth:`_run` on its loop."""

    engine: ServedEngine

    async def _run(self, fn: Any) -> Any:
        """Run ``fn`` between two engine steps and await its result."""
        return await asyncio.wrap_future(self.engine.scheduler.call(fn))
