"""Weight versions on the wire.

LoongSage's weight versions are integers (``Segment.weight_versions``); SGLang's HTTP API sends
them as strings (``"weight_version": "3"``). :func:`parse_weight_version` is the one reading of
such a value, shared by the engine clients, the router and the embedded engine's request parser;
each caller decides what an unreadable value means for it (keep it, -1, a request error).
"""

from __future__ import annotations

from typing import Any


def parse_weight_version(value: Any) -> int | None:
    """``value`` as an integer weight version (an int, or its decimal string with optional sign
    and surrounding blanks), or ``None`` when it is not one (``None``, a bool, other text, ...)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text[:1] in ("+", "-") else text
        if digits.isascii() and digits.isdigit():
            return int(text)
    return None
