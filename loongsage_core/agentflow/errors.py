"""Errors the AgentFlow router answers with, in the error-body format of the agent's protocol.

Agents talk to the router through ordinary SDKs, so every failure must look like that API's
error: an HTTP status plus ``{"error": {"message", "type", "param", "code"}}`` for OpenAI's
protocols, ``{"type": "error", "error": {"type", "message"}}`` for Anthropic's. The official SDKs
turn those into ``BadRequestError``, ``NotFoundError``, ... exceptions.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class RouterError(Exception):
    """A request the router refuses or cannot serve; rendered as an OpenAI error body.

    ``retry`` tells OpenAI SDKs whether retrying may help (sent as the ``x-should-retry``
    header, which the official SDKs honour before their own status-code rules). ``engine_url``
    names the engine when an engine call failed.
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry: bool | None = None,
                 engine_url: str | None = None) -> None:
        super().__init__(message)
        self.engine_url = engine_url  # the engine a failed engine call went to
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry = retry

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry is None:
            return {}
        return {"x-should-retry": "true" if self.retry else "false"}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> RouterError:
    """A 400 ``invalid_request_error`` naming the offending parameter."""
    return RouterError(400, message, param=param, code=code, retry=False)


def not_found(message: str, code: str = "not_found") -> RouterError:
    """A 404 (unknown trajectory, stale attempt, unknown path)."""
    return RouterError(404, message, code=code, retry=False)


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error_body(exc: RouterError) -> dict[str, Any]:
    """The error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ANTHROPIC_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    message = exc.message if exc.param is None or exc.param in exc.message else f"{exc.param}: {exc.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is under Anthropic's Messages endpoint (``.../v1/messages[/...]``)."""
    path = path.rstrip("/")
    return path.endswith("/v1/messages") or "/v1/messages/" in path


def error_response_body(path: str, exc: RouterError, headers: Any = None) -> dict[str, Any]:
    """The error body in the shape of the protocol the request speaks: Anthropic's for its
    endpoints and for requests that carry an ``anthropic-version`` header (the ``anthropic``
    SDK and Claude Code send it), else OpenAI's."""
    anthropic = is_anthropic_path(path) or (headers is not None and "anthropic-version" in headers)
    return anthropic_error_body(exc) if anthropic else exc.body()


def as_router_error(exc: Exception) -> Any:
    """``exc`` as a :class:`RouterError` a stream can report (a bug becomes a 500, logged)."""
    if isinstance(exc, RouterError):
        return exc
    log.error("AgentFlow router: a streamed turn failed", exc_info=exc)
    return RouterError(500, f"internal router error: {type(exc).__name__}: {exc}", type="server_error", retry=False)
