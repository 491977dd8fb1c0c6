"""The shared pieces of request validation: the error every check raises, and small typed readers.

:class:`InvalidRequest` is what :mod:`.protocol` (``/generate``) and :mod:`.control_protocol`
(the control endpoints) raise for a bad field; the server turns it into HTTP 400 with
``{"error": {"message", "type": "invalid_request_error", "param"}}``. The readers check one JSON
value's type, and :func:`check_unknown` rejects fields outside a body's known set (SGLang fields
the engine does not implement pass only at their neutral default, judged by the ``is_*`` checks).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping


class InvalidRequest(ValueError):
    """A request body is malformed; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param}}

def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_bool(body: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidRequest(f"'{where}{key}' must be a boolean, got {v!r}", where + key)
    return v


def require_object(body: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"the request body of {what} must be a JSON object, got {type(body).__name__}")
    return body


def check_unknown(body: Mapping[str, Any], allowed: set[str], neutral: Mapping[str, Callable[[Any], bool]],
                   where: str = "") -> None:
    """Reject fields outside ``allowed``; SGLang fields in ``neutral`` pass only at a neutral value."""
    for key, value in body.items():
        if key in allowed:
            continue
        if key in neutral:
            if not neutral[key](value):
                raise InvalidRequest(
                    f"'{where}{key}' = {value!r} is not supported by the embedded engine "
                    f"(only its default is accepted)", where + key)
            continue
        raise InvalidRequest(f"unknown field '{where}{key}'", where + key)


def is_none(v: Any) -> bool:
    return v is None


def is_none_or_false(v: Any) -> bool:
    return v is None or v is False


def is_empty(v: Any) -> bool:
    return v is None or v == [] or v == "" or v == {}
