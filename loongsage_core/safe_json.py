"""Parsing JSON that comes from outside, with bounds checked before the parser recurses.

``json.loads`` recurses once per nesting level: a request body or a data file line that nests
100,000 arrays deep raises ``RecursionError`` (or worse, exhausts the C stack) instead of a clear
error, and so does every function that later walks the parsed value. :func:`loads` first measures
the text in linear time at C speed (strings blanked out, the running depth of the brackets left
summed up with numpy) and refuses, with a :class:`JsonLimitError` naming
the limit, a text nested deeper than ``max_depth`` or holding more than ``max_items`` values; only
then does it parse. It also refuses numbers JSON cannot carry back out (``NaN``, ``Infinity``,
``1e999``). :class:`JsonLimitError` is a ``ValueError``, so callers that turn invalid JSON into a
clear error (a 400, a ``ConfigError``) treat an over-deep text the same way.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

DEFAULT_MAX_DEPTH = 64
"""Nesting levels (objects and arrays) a text may have; real requests and data rows use a few dozen at most."""
DEFAULT_MAX_ITEMS = 1_000_000
"""Values (array elements and object members) a text may hold."""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b"[]{},")


class JsonLimitError(ValueError):
    """A JSON text beyond :func:`loads`' bounds (nested too deep, too many values, a non-finite number)."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonLimitError(f"the number {text[:40]} is out of range (JSON numbers must be finite)")
    return value


def _no_constant(name: str) -> Any:
    raise JsonLimitError(f"{name} is not a JSON value")


def check_bounds(text: str | bytes, max_depth: int = DEFAULT_MAX_DEPTH, max_items: int = DEFAULT_MAX_ITEMS) -> None:
    """Raise :class:`JsonLimitError` if the JSON ``text`` nests deeper than ``max_depth`` or holds
    more than ``max_items`` values (a malformed text passes: the parser reports it). Linear time at
    C speed: strings are blanked out, then the running depth of the brackets left is summed up."""
    import numpy as np

    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    structure = _STRING.sub(b"0", data).translate(None, _NOT_STRUCTURE)
    if structure.count(b",") + 1 > max_items:
        raise JsonLimitError(f"the JSON holds more than {max_items} values")
    brackets = np.frombuffer(structure.replace(b",", b""), dtype=np.uint8)
    # "[" and "{" have bit 1 set, "]" and "}" do not: +1 opens a level, -1 closes one
    steps = ((brackets >> 1) & 1).astype(np.int8) * 2 - 1
    if steps.size and int(np.cumsum(steps, dtype=np.int32).max()) > max_depth:
        raise JsonLimitError(f"the JSON nests deeper than {max_depth} levels")


def loads(text: str | bytes, max_depth: int = DEFAULT_MAX_DEPTH, max_items: int = DEFAULT_MAX_ITEMS) -> Any:
    """``json.loads(text)`` within bounds; any problem is a ``ValueError`` (``json.JSONDecodeError``
    for invalid JSON, :class:`JsonLimitError` for one beyond the bounds)."""
    check_bounds(text, max_depth, max_items)
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:  # a bound above the interpreter's recursion limit
        raise JsonLimitError("the JSON nests too deep to parse") from None
