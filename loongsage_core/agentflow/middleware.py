"""Building the router's middleware chain from the job file's ordered list.

Middleware is applied in the order the job file lists it (``on_request`` first to last, then
``on_response`` first to last), never in plugin registration order.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from loongsage_hookspecs import BuildContext


def build_middlewares(components: Any, entries: Sequence[str | Mapping[str, Any]],
                      where: str = "agentflow") -> list[Any]:
    """Instantiate middleware by name, in order.

    ``components`` builds them (a ``ComponentRegistry``, such as the host's plugin registry); each
    entry is a name or ``{"name": ..., "args": {...}}``; ``where`` prefixes the job-file keys that
    errors name (``<job>: agentflow``).
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
        # the build checks the RouterMiddleware protocol (on_request/on_response)
        ctx = BuildContext(where=f"{where}.middleware[{i}]", components=components)
        chain.append(components.build("router_middleware", name, ctx,
                                      args_key=f"{where}.middleware_args.{name}", **args))
    return chain
