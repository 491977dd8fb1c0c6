"""Errors the AgentFlow router answers with, in the OpenAI error-body format.

Agents talk to the router through ordinary OpenAI clients, so every failure must look like an
OpenAI API error: an HTTP status plus ``{"error": {"message", "type", "param", "code"}}``. The
official SDK turns those into ``BadRequestError``, ``NotFoundError``, ... exceptions.
"""

from __future__ import annotations

from typing import Any


class RouterError(Exception):
    """A request the router refuses or cannot serve; rendered as an OpenAI error body.

    ``retry`` tells OpenAI SDKs whether retrying may help (sent as the ``x-should-retry``
    header, which the official SDKs honour before their own status-code rules).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry: bool | None = None) -> None:
        super().__init__(message)
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
