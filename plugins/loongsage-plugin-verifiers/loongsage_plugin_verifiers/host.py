"""The process's verifiers host: one background event loop that plays every episode.

A verifiers environment is *served* while it plays (``Env.serving()``): its interception pool (the
local OpenAI-compatible servers its harness programs talk to, which relay each model call to the
trajectory's endpoint and record the trace) and its taskset's shared tool servers live across
the episodes played at the same time. LoongSage builds an agent per trajectory and drives
rollouts from its controller's loop, which only runs while a step generates, so the served
environments live here instead: a daemon thread with its own loop, where an environment enters
``serving()`` when an episode starts and none of its episodes is running, and leaves it when its
last running episode ends (so its servers and tool processes are up while a step's episodes
play, and never outlive them). Agents submit an episode with :meth:`EnvHost.run_episode` and
await it from any loop; cancelling the awaiting task cancels the episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class EnvHost:
    """A background event loop holding served verifiers environments (see the module doc)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._served: dict[str, contextlib.AsyncExitStack] = {}
        self._running: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._thread = threading.Thread(target=self._run, name="loongsage-verifiers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _enter(self, key: str, environment: Any) -> None:
        async with self._locks.setdefault(key, asyncio.Lock()):
            if key not in self._served:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(environment.serving())
                self._served[key] = stack
            self._running[key] = self._running.get(key, 0) + 1

    async def _leave(self, key: str) -> None:
        async with self._locks[key]:
            self._running[key] -= 1
            if self._running[key] == 0:
                del self._running[key]
                await self._served.pop(key).aclose()

    async def _episode(self, key: str, environment: Any, task: Any, ctx: Any) -> Any:
        await self._enter(key, environment)
        try:
            (slot,) = environment.slots(task)
            return await environment.run_slot(slot, ctx)
        finally:
            await asyncio.shield(self._leave(key))

    async def run_episode(self, key: str, environment: Any, task: Any, ctx: Any) -> Any:
        """Play one episode of ``task`` with model context ``ctx`` on the served environment
        ``environment`` (``key``: its configuration's identity); awaitable from any loop."""
        future = asyncio.run_coroutine_threadsafe(self._episode(key, environment, task, ctx), self.loop)
        return await asyncio.wrap_future(future)

    async def _close_all(self) -> None:
        while self._served:
            key, stack = self._served.popitem()
            try:
                await stack.aclose()
            except Exception:
                log.exception("stopping the verifiers environment %s failed", key)

    def close(self, timeout_s: float = 60.0) -> None:
        """Leave every environment's ``serving()`` (stopping its servers) and stop the loop."""
        if not self.loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close_all(), self.loop).result(timeout_s)
        except Exception:
            log.exception("stopping the verifiers environments failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)


_HOST: EnvHost | None = None
_HOST_LOCK = threading.Lock()


def env_host() -> EnvHost:
    """The process's :class:`EnvHost`, started on first use.

    Starting it also puts this interpreter's ``bin`` directory (where the pinned ``uv`` is
    installed) on ``PATH``: verifiers prepares every harness program with ``uv`` and otherwise
    installs one into the user's home."""
    global _HOST
    with _HOST_LOCK:
        if _HOST is None:
            bin_dir = str(Path(sys.executable).parent)
            path = os.environ.get("PATH", "")
            if bin_dir not in path.split(os.pathsep):
                os.environ["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir
            _HOST = EnvHost()
        return _HOST


def shutdown() -> None:
    """Stop the served environments and the host's loop (a later episode starts a new host)."""
    global _HOST
    with _HOST_LOCK:
        host, _HOST = _HOST, None
    if host is not None:
        host.close()
