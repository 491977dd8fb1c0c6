"""One way to serve an aiohttp application from a background thread (shared by the host and plugins).

The AgentFlow router, the embedded rollout engine and the run viewer all serve HTTP from inside a
process that has other work to do (a synchronous driver, a Ray actor, a test): each runs an
aiohttp application on an event loop of its own, in a daemon thread. :class:`ThreadedServer` is
that thread: :meth:`~ThreadedServer.start` binds ``host:port`` (port 0: the OS picks a free one)
and returns the base URL with the bound port, :meth:`~ThreadedServer.stop` shuts the application
down gracefully (its ``on_shutdown`` / ``on_cleanup`` signals run on its loop) and joins the
thread, :meth:`~ThreadedServer.call` is the bridge that lets synchronous code run a coroutine on
the server's loop and wait for it, and :class:`BlockingView` turns an object's ``a``-prefixed
coroutine methods into blocking calls through that bridge.

:func:`secret_middleware` is the security hook: health probes (:data:`~.security.OPEN_PATHS`) are
open, every other path needs the run secret (or a credential the server itself accepts, such as
the router's per-trajectory keys).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

from .security import OPEN_PATHS, presented_token, token_matches

T = TypeVar("T")

Refusal = Callable[[Any, "str | None"], Any]
"""``refuse(request, token)``: the answer to a request without a valid credential (a response, or it raises)."""


class ThreadedServer:
    """An aiohttp application served on its own event loop in a background thread.

    Args:
        app: the ``aiohttp.web.Application`` to serve (its startup/cleanup signals run on the
            server's loop, so per-loop resources such as client sessions belong there).
        host: the address to bind.
        port: the port to bind (0: a free one, reported by :attr:`port` once started).
        advertise: the host the base URL names, where clients reach the server (default: ``host``;
            a server bound to ``0.0.0.0`` advertises its node's address).
        name: the thread's name (seen in thread dumps and logs).
        handler_cancellation: cancel a handler when its client disconnects (aiohttp's option).
        shutdown_timeout: seconds :meth:`stop` lets open requests finish.
    """

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
                 name: str = "http-server", handler_cancellation: bool = False, shutdown_timeout: float = 5.0) -> None:
        self.app = app
        self.host = host
        self.advertise = advertise or host
        self.port = int(port)
        self.name = name
        self.handler_cancellation = handler_cancellation
        self.shutdown_timeout = shutdown_timeout
        self.base_url: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, timeout_s: float = 30.0) -> str:
        """Serve in a background thread; returns ``http://HOST:PORT`` (the bound port).

        Idempotent while running. A failure to bind or to start the application is raised here.
        """
        if self._thread is not None:
            assert self.base_url is not None
            return self.base_url
        ready: concurrent.futures.Future[str] = concurrent.futures.Future()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self.loop = loop
            try:
                ready.set_result(loop.run_until_complete(self._astart()))
            except BaseException as exc:  # reported to start()
                loop.run_until_complete(self._astop())
                loop.close()
                ready.set_exception(exc)
                return
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._astop())
                loop.close()

        self._thread = threading.Thread(target=serve, name=self.name, daemon=True)
        self._thread.start()
        try:
            return ready.result(timeout=timeout_s)
        except BaseException:
            self._thread = None
            self.loop = None
            raise

    async def _astart(self) -> str:
        from aiohttp import web

        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                     handler_cancellation=self.handler_cancellation,
                                     shutdown_timeout=self.shutdown_timeout)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = int(self._runner.addresses[0][1])
        self.base_url = f"http://{self.advertise}:{self.port}"
        return self.base_url

    async def _astop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut the application down (open requests get ``shutdown_timeout``) and join the thread."""
        thread, loop = self._thread, self.loop
        if thread is None or loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():  # on the server thread itself: it stops once this returns
            thread.join(timeout=timeout_s)
        self._thread = None
        self.loop = None
        self.base_url = None

    def in_server_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = 60.0) -> T:
        """Run ``coro`` on the server's loop from another thread and wait for its result."""
        if self.loop is None:
            coro.close()
            raise RuntimeError(f"{self.name} is not started; call start() first")
        if self.in_server_thread():
            coro.close()
            raise RuntimeError(f"blocking call on the {self.name} thread; await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def on_loop(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the server's loop from any event loop (directly when already on it)."""
        loop = self.loop
        if loop is None:
            raise RuntimeError(f"{self.name} is not started; call start() first")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return fn()

        async def run() -> T:
            return fn()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), loop))


class BlockingView:
    """Synchronous access to an object's coroutine methods: ``view.name(...)`` runs
    ``await target.aname(...)`` through ``bridge`` (e.g. :meth:`ThreadedServer.call`) and returns
    its result. One bridge instead of a synchronous twin of every method."""

    def __init__(self, target: Any, bridge: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        self._target = target
        self._bridge = bridge

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._target, "a" + name, None)
        if name.startswith("_") or not callable(method):
            raise AttributeError(f"{type(self._target).__name__} has no coroutine method 'a{name}'")

        def blocking(*args: Any, **kwargs: Any) -> Any:
            coro: Awaitable[Any] = method(*args, **kwargs)
            return self._bridge(coro)  # type: ignore[arg-type]

        blocking.__name__ = name
        blocking.__doc__ = method.__doc__
        return blocking


def secret_middleware(secret: str | None, refuse: Refusal,
                      also_accepts: Callable[[Any, str], bool] | None = None) -> Any:
    """aiohttp middleware that lets a request through when it may reach its path.

    Without a ``secret`` everything is open. With one, the health probes are open to anyone and
    every other path needs ``Authorization: Bearer <secret>`` (or ``x-api-key``), or a token
    ``also_accepts(request, token)`` approves; anything else gets ``refuse(request, token)``
    (``token`` is ``None`` when the request carried none).
    """
    from aiohttp import web

    @web.middleware
    async def check_secret(request: Any, handler: Any) -> Any:
        if secret is None or request.path in OPEN_PATHS:
            return await handler(request)
        token = presented_token(request.headers)
        if token_matches(token, secret) or (token is not None and also_accepts is not None
                                            and also_accepts(request, token)):
            return await handler(request)
        return refuse(request, token)

    return check_secret
