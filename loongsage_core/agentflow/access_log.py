"""The router's access log: one line per HTTP request (method, path, status, milliseconds).

Black-box agents hide their failures (a CLI may retry, fall back or print nothing), so the router
keeps its own record of what it answered: the last entries in memory (``AgentFlowRouter.access_log``
and ``GET /admin/access_log``), every entry on the ``loongsage.agentflow.access`` logger, and
optionally a JSON-lines file. A stream that fails after its 200 header was sent is logged with the
status of the error it reported.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from typing import Any

log = logging.getLogger("loongsage.agentflow.access")


class AccessLog:
    """Bounded in-memory access log with an optional JSON-lines file."""

    def __init__(self, path: str | None = None, keep: int = 10000) -> None:
        self.path = path
        self._entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()

    def add(self, method: str, path: str, status: int, ms: float) -> None:
        entry = {"time": time.time(), "method": method, "path": path, "status": status, "ms": round(ms, 3)}
        with self._lock:
            self._entries.append(entry)
            if self.path:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(entry) + "\n")
        log.info("%s %s %d %.1fms", method, path, status, ms)

    def entries(self) -> list[dict[str, Any]]:
        """A copy of the entries kept, oldest first."""
        with self._lock:
            return list(self._entries)

    def errors(self) -> list[dict[str, Any]]:
        """The entries with a 4xx or 5xx status."""
        return [e for e in self.entries() if e["status"] >= 400]

    def middleware(self) -> Any:
        """An aiohttp middleware that records every request (put it first, outside error handling)."""
        from aiohttp import web

        from ._request_keys import STATUS

        @web.middleware
        async def access(request: Any, handler: Any) -> Any:
            started = time.perf_counter()
            status = 500
            try:
                response = await handler(request)
                status = response.status
                return response
            except web.HTTPException as exc:
                status = exc.status
                raise
            except BaseException:
                status = 499  # the client went away (or the server failed) before an answer
                raise
            finally:
                status = int(request.get(STATUS, status))
                self.add(request.method, request.path_qs, status, (time.perf_counter() - started) * 1000)

        return access
