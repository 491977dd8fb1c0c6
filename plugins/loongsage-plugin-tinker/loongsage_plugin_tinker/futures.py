"""Tinker's futures: every training and sampling call answers a request id at once, and the SDK
polls ``/api/v1/retrieve_future`` for the result.

A retrieve waits (long-polls) up to ``poll_s`` for the work to finish, then answers
``{"type": "try_again", ...}`` so the SDK asks again. A finished request answers its result: a
JSON object, or protobuf bytes for the types the SDK reads only as protobuf; a failed one answers
``{"error": ..., "category": "user" | "server"}``, which the SDK raises as ``RequestFailedError``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Awaitable, Callable

import attrs

from .batches import TinkerRequestError

log = logging.getLogger("loongsage.tinker")


@attrs.define
class Outcome:
    """A finished request: ``body`` (a JSON-able dict, or protobuf bytes) or an ``error``."""

    body: dict[str, Any] | bytes | None = None
    error: str | None = None
    category: str = "user"


class FutureStore:
    """Requests in flight and their outcomes, by request id (on the server's event loop)."""

    def __init__(self, poll_s: float = 20.0, keep_s: float = 600.0) -> None:
        self.poll_s = poll_s
        self.keep_s = keep_s
        self._tasks: dict[str, asyncio.Task[Outcome]] = {}

    def submit(self, work: Callable[[], Awaitable[dict[str, Any] | bytes]], kind: str) -> str:
        """Run ``work`` in the background; returns its request id."""
        request_id = f"{kind}-{uuid.uuid4().hex}"

        async def run() -> Outcome:
            try:
                return Outcome(body=await work())
            except TinkerRequestError as exc:
                return Outcome(error=str(exc), category="user")
            except Exception as exc:  # reported to the client, which raises RequestFailedError
                log.exception("tinker %s request %s failed", kind, request_id)
                return Outcome(error=f"{type(exc).__name__}: {exc}", category="server")

        self._tasks[request_id] = asyncio.ensure_future(run())
        return request_id

    async def retrieve(self, request_id: str) -> Outcome | None:
        """The outcome of ``request_id``, waiting up to ``poll_s``; ``None`` while it still runs.
        An unknown id raises :class:`KeyError`."""
        task = self._tasks[request_id]
        done, _ = await asyncio.wait({task}, timeout=self.poll_s)
        if not done:
            return None
        # retrieved: kept a while longer for a client that retries the retrieve, then forgotten
        asyncio.get_running_loop().call_later(self.keep_s, self._tasks.pop, request_id, None)
        if task.cancelled():
            return Outcome(error=f"request {request_id} was cancelled", category="user")
        return task.result()

    def cancel(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()
