"""The client of SGLang's native HTTP API that drives every engine (loads httpx on first use)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ..engine_client import EngineClient


def __getattr__(name: str) -> Any:
    if name == "EngineClient":
        from ..engine_client import EngineClient

        return EngineClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EngineClient"]
