"""Building the router's middleware chain from the job file's ordered list.

Middleware is applied in the order the job file lists it (``on_request`` first to last, then
``on_response`` first to last), never in plugin registration order.
"""

from __future__ import annotations

from typing import Any, Sequence

from loongsage_hookspecs import BuildContext, ComponentRef, ComponentRegistry


def build_middlewares(components: ComponentRegistry, refs: Sequence[ComponentRef], job: Any = None) -> list[Any]:
    """The router middleware ``refs`` name, bound in order through ``components`` (binding checks
    the RouterMiddleware protocol: ``on_request`` / ``on_response``); ``job``: the job's settings
    the middleware may read (``None`` outside a run)."""
    return [components.bind(ref, BuildContext(where=ref.where, job=job, components=components)) for ref in refs]
