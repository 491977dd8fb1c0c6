"""Building the router's middleware chain from the job file's ordered list.

Middleware is applied in the order the job file lists it (``on_request`` first to last, then
``on_response`` first to last), never in plugin registration order.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def build_middlewares(components: Any, entries: Sequence[str | Mapping[str, Any]]) -> list[Any]:
    """Instantiate middleware by name, in order.

    ``components`` resolves names (an object with ``get(kind, name) -> RouterMiddlewareSpec``,
    such as the host's plugin registry); each entry is a name or ``{"name": ..., "args": {...}}``.
    """
    chain = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            name, args = entry, {}
        elif isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            unknown = set(entry) - {"name", "args"}
            if unknown:
                raise ValueError(f"router middleware #{i}: unknown keys {sorted(unknown)} (use 'name' and 'args')")
            name, args = entry["name"], dict(entry.get("args") or {})
        else:
            raise ValueError(f"router middleware #{i}: expected a name or {{name, args}}, got {entry!r}")
        spec = components.get("router_middleware", name)
        mw = spec.factory(**args)
        if not (callable(getattr(mw, "on_request", None)) and callable(getattr(mw, "on_response", None))):
            raise TypeError(f"router middleware {name!r} built an object without on_request/on_response")
        chain.append(mw)
    return chain
