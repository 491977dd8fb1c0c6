"""``loongsage view``: a local web page over one or more run directories.

An aiohttp server on the loopback interface serves the page (``static/``: our HTML, CSS and
JavaScript plus the vendored uPlot charting library, so no network is needed) and a small JSON API
the page polls to follow a live run:

* ``GET /api/runs`` -- each run: name, path, steps with metrics, steps with records, finished;
* ``GET /api/runs/{run}/metrics?since=N`` -- the ``metrics.jsonl`` rows of steps ``>= N``;
* ``GET /api/runs/{run}/steps/{step}`` -- the step's trajectory table (and a problem, if its
  records file could not be read whole);
* ``GET /api/runs/{run}/steps/{step}/{index}`` -- one trajectory's full record.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any, Sequence

from aiohttp import web

from ..http_server import ThreadedServer
from .runs import RunDir, trajectory_row

STATIC = Path(__file__).resolve().parent / "static"
HOST = "127.0.0.1"

log = logging.getLogger("loongsage")


def _names(dirs: Sequence[str]) -> list[str]:
    """Short distinct labels for the runs: the directory name, with its parent where names clash."""
    paths = [Path(d).resolve() for d in dirs]
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


def build_app(dirs: Sequence[str]) -> web.Application:
    """The viewer's aiohttp application over ``dirs`` (each checked to be a run directory)."""
    runs = [RunDir(d, name) for d, name in zip(dirs, _names(dirs))]
    app = web.Application()

    def run_of(request: web.Request) -> RunDir:
        try:
            return runs[int(request.match_info["run"])]
        except (ValueError, IndexError):
            raise web.HTTPNotFound(text=f"no run {request.match_info['run']!r}") from None

    def step_of(request: web.Request) -> int:
        try:
            return int(request.match_info["step"])
        except ValueError:
            raise web.HTTPBadRequest(text=f"step must be an integer, got {request.match_info['step']!r}") from None

    async def index(_: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def api_runs(_: web.Request) -> web.Response:
        return web.json_response({"runs": [r.summary(i) for i, r in enumerate(runs)]})

    async def api_metrics(request: web.Request) -> web.Response:
        run = run_of(request)
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            raise web.HTTPBadRequest(text="since must be an integer") from None
        return web.json_response({"rows": [m for m in run.metrics() if m["step"] >= since]})

    def records(run: RunDir, step: int) -> tuple[list[dict[str, Any]], str | None]:
        try:
            return run.records(step)
        except FileNotFoundError:
            raise web.HTTPNotFound(text=f"{run.name}: no rollout records for step {step} (yet)") from None

    async def api_step(request: web.Request) -> web.Response:
        run, step = run_of(request), step_of(request)
        recs, problem = await asyncio.get_running_loop().run_in_executor(None, records, run, step)
        return web.json_response({"step": step, "rows": [trajectory_row(r) for r in recs], "problem": problem})

    async def api_trajectory(request: web.Request) -> web.Response:
        run, step = run_of(request), step_of(request)
        recs, _ = await asyncio.get_running_loop().run_in_executor(None, records, run, step)
        wanted = request.match_info["index"]
        for r in recs:
            if str(r.get("index")) == wanted:
                return web.json_response(r)
        raise web.HTTPNotFound(text=f"{run.name}: step {step} has no trajectory {wanted}")

    app.router.add_get("/", index)
    app.router.add_get("/api/runs", api_runs)
    app.router.add_get("/api/runs/{run}/metrics", api_metrics)
    app.router.add_get("/api/runs/{run}/steps/{step}", api_step)
    app.router.add_get("/api/runs/{run}/steps/{step}/{index}", api_trajectory)
    app.router.add_static("/static/", STATIC)
    return app


class ViewerServer:
    """The viewer served from a background thread (for tests and embedding); :meth:`start` returns
    its URL, :meth:`stop` ends it."""

    def __init__(self, dirs: Sequence[str], port: int = 0) -> None:
        self.app = build_app(dirs)  # checks the directories before anything starts
        self.port = port
        self.url = ""
        self._server = ThreadedServer(self.app, host=HOST, port=port, name="loongsage-view")

    def start(self) -> str:
        self.url = self._server.start() + "/"
        self.port = self._server.port
        return self.url

    def stop(self) -> None:
        self._server.stop()


def serve(dirs: Sequence[str], port: int = 0, open_browser: bool = False) -> None:
    """Serve the viewer until interrupted (``loongsage view``)."""
    server = ViewerServer(dirs, port)
    url = server.start()
    print(f"LoongSage run viewer: {url}  (runs: {', '.join(map(str, dirs))}; Ctrl-C stops it)", flush=True)
    if open_browser:
        import webbrowser

        webbrowser.open(url)
    try:
        threading.Event().wait()
    finally:
        server.stop()
