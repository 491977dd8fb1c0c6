"""The shared threaded aiohttp server: binding, the bridge from synchronous code, graceful stop, the secret hook."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
from aiohttp import web

from loongsage_core.http_server import BlockingView, ThreadedServer, secret_middleware

SECRET = "s3cret"


def app_with(*middlewares) -> web.Application:
    app = web.Application(middlewares=list(middlewares))

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"thread": threading.current_thread().name})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.router.add_get("/hello", hello)
    app.router.add_get("/health", health)
    return app


def test_serves_on_a_chosen_port_from_its_own_thread_and_stops():
    server = ThreadedServer(app_with(), name="test-http")
    url = server.start()
    try:
        assert server.port > 0 and url == f"http://127.0.0.1:{server.port}"
        assert server.start() == url  # idempotent while running
        assert httpx.get(url + "/hello").json() == {"thread": "test-http"}
    finally:
        server.stop()
    assert not server.running and server.base_url is None
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/hello", timeout=5)
    server.stop()  # idempotent


def test_the_base_url_names_the_advertised_host():
    server = ThreadedServer(app_with(), host="0.0.0.0", advertise="127.0.0.1")
    url = server.start()
    try:
        assert url == f"http://127.0.0.1:{server.port}"
        assert httpx.get(url + "/health").status_code == 200
    finally:
        server.stop()


def test_cleanup_runs_on_the_server_loop_when_stopped():
    seen: list[str] = []
    app = app_with()

    async def cleanup(_app: web.Application) -> None:
        seen.append(threading.current_thread().name)

    app.on_cleanup.append(cleanup)
    server = ThreadedServer(app, name="test-cleanup")
    server.start()
    server.stop()
    assert seen == ["test-cleanup"]


def test_a_port_in_use_is_reported_by_start():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ThreadedServer(app_with(), port=port)
        with pytest.raises(OSError):
            server.start()
        assert not server.running


def test_call_and_blocking_view_run_coroutines_on_the_server_loop():
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        async def aadd(self, k: int) -> tuple[int, str]:
            self.n += k
            return self.n, threading.current_thread().name

    server = ThreadedServer(app_with(), name="test-bridge")
    with pytest.raises(RuntimeError, match="not started"):
        server.call(asyncio.sleep(0))
    server.start()
    try:
        counter = Counter()
        view = BlockingView(counter, server.call)
        assert view.add(2) == (2, "test-bridge")
        assert server.call(counter.aadd(3)) == (5, "test-bridge")
        with pytest.raises(AttributeError, match="'amissing'"):
            view.missing()

        async def from_another_loop() -> int:
            return await server.on_loop(lambda: counter.n)

        assert asyncio.run(from_another_loop()) == 5
    finally:
        server.stop()


def test_secret_middleware_opens_health_and_what_the_server_accepts():
    def refuse(request: web.Request, token: str | None) -> web.Response:
        return web.json_response({"token": token}, status=401 if token is None else 403)

    def also(request: web.Request, token: str) -> bool:
        return token == "guest" and request.path == "/hello"

    server = ThreadedServer(app_with(secret_middleware(SECRET, refuse, also_accepts=also)))
    url = server.start()
    try:
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/hello").status_code == 401
        assert httpx.get(url + "/hello", headers={"Authorization": "Bearer wrong"}).json() == {"token": "wrong"}
        assert httpx.get(url + "/hello", headers={"Authorization": f"Bearer {SECRET}"}).status_code == 200
        assert httpx.get(url + "/hello", headers={"x-api-key": SECRET}).status_code == 200
        assert httpx.get(url + "/hello", headers={"x-api-key": "guest"}).status_code == 200
    finally:
        server.stop()
    open_server = ThreadedServer(app_with(secret_middleware(None, refuse)))
    try:
        assert httpx.get(open_server.start() + "/hello").status_code == 200
    finally:
        open_server.stop()
