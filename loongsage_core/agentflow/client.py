"""A client for a router in another process (a Ray actor, ``loongsage serve``): the ``/admin`` API.

:class:`RouterClient` has the same trajectory API as :class:`~.router.AgentFlowRouter`:
coroutines (``aregister``, ``aget``, ``apop``, ``aabort``, ``astats``) and, for synchronous
code, the same ``blocking`` view (``client.blocking.register(...)``), so
:func:`~.runner.run_agent_trajectory` and their other callers work with either.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

from ..http_server import BlockingView
from ..security import trajectory_key as derive_trajectory_key
from .record import TrajectoryRecord


class RouterClientError(RuntimeError):
    """The router refused an admin call (the message is the router's error message)."""


class RouterClient:
    """Talks to a running router at ``base_url`` (``http://host:port``); ``api_key`` is the run
    secret (``/admin`` needs it; ``None`` for a router without one)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.blocking = BlockingView(self, asyncio.run)
        """Synchronous trajectory API (from code outside an event loop): ``client.blocking.pop(tid)``."""

    def url_for(self, trajectory_id: str, attempt: int = 0) -> str:
        return f"{self.base_url}/{trajectory_id}/{int(attempt)}/v1"

    def trajectory_key(self, trajectory_id: str, attempt: int = 0) -> str:
        """The key an agent sends for this trajectory attempt (see ``AgentFlowRouter.trajectory_key``)."""
        return derive_trajectory_key(self.api_key, trajectory_id, attempt) if self.api_key else "loongsage"

    @staticmethod
    def _check(resp: Any) -> Any:
        data = resp.json()
        if resp.status_code >= 400:
            err = data.get("error", {}) if isinstance(data, dict) else {}
            raise RouterClientError(f"router answered {resp.status_code}: {err.get('message', data)}")
        return data

    async def _arequest(self, method: str, path: str, body: Any = None) -> Any:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            resp = await client.request(method, self.base_url + path, json=body, headers=self.headers)
        return self._check(resp)

    @staticmethod
    def _register_body(trajectory_id: str, attempt: int, sampling: Mapping[str, Any] | None,
                       max_response_tokens: int | None, max_context_length: int | None,
                       metadata: Mapping[str, Any] | None, priority: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"trajectory_id": trajectory_id, "attempt": attempt}
        for key, value in (("sampling", sampling), ("max_response_tokens", max_response_tokens),
                           ("max_context_length", max_context_length), ("metadata", metadata),
                           ("priority", priority)):
            if value is not None:
                body[key] = dict(value) if isinstance(value, Mapping) else value
        return body

    async def aregister(self, trajectory_id: str, *, attempt: int = 0, sampling: Mapping[str, Any] | None = None,
                        max_response_tokens: int | None = None, max_context_length: int | None = None,
                        metadata: Mapping[str, Any] | None = None, priority: int | None = None) -> str:
        """Register a trajectory; returns its base URL (see ``AgentFlowRouter.aregister``)."""
        body = self._register_body(trajectory_id, attempt, sampling, max_response_tokens, max_context_length, metadata,
                                   priority)
        return (await self._arequest("POST", "/admin/trajectories", body))["base_url"]

    async def aget(self, trajectory_id: str) -> TrajectoryRecord:
        return TrajectoryRecord.from_dict(await self._arequest("GET", f"/admin/trajectories/{trajectory_id}"))

    async def apop(self, trajectory_id: str) -> TrajectoryRecord:
        return TrajectoryRecord.from_dict(await self._arequest("DELETE", f"/admin/trajectories/{trajectory_id}"))

    async def aabort(self, trajectory_id: str) -> None:
        await self._arequest("POST", f"/admin/trajectories/{trajectory_id}/abort")

    async def astats(self) -> dict[str, Any]:
        return await self._arequest("GET", "/admin/stats")
