"""The router's HTTP application: routes, the admin API, authentication and error answers.

Routes: every protocol adapter's turn endpoints under ``/{trajectory_id}/{attempt}/v1``, the
trajectory's base URL (clients probe it), ``/health``, and the admin API under ``/admin``
(register, read, pop and abort trajectories, switch engines, counters, the access log), which is
the same trajectory API :class:`~.router.AgentFlowRouter` offers in Python.

Security (:mod:`loongsage_core.security`): with the run secret, ``/health`` is open, ``/admin/*``
and every other path need the secret, and a trajectory's endpoints (whatever the protocol) accept
the secret or that attempt's own key, so an agent can reach its own endpoint and nothing else. The
check is one middleware, so routes added later are covered. Every error is answered in the
OpenAI error format (:mod:`.errors`); a client that went away is not an error worth a log line.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ..http_server import secret_middleware
from . import anthropic_api, openai_api, responses_api
from .access_log import AccessLog
from .engines import EngineBalancer
from .errors import RouterError, bad_request, error_response_body
from .protocol import json_response, read_json
from .registry import TrajectoryRegistry, check_trajectory_id
from .turns import TurnRunner

log = logging.getLogger(__name__)

REGISTER_FIELDS = frozenset({"trajectory_id", "attempt", "sampling", "max_response_tokens", "max_context_length",
                             "metadata", "priority"})
"""The fields of ``POST /admin/trajectories``."""


class ServedRouter(Protocol):
    """What the application needs of the router (:class:`~.router.AgentFlowRouter`)."""

    turns: TurnRunner
    registry: TrajectoryRegistry
    balancer: EngineBalancer
    known_engines: set[str]
    access_log: AccessLog
    secret: str | None
    max_request_bytes: int

    def url_for(self, trajectory_id: str, attempt: int = 0) -> str: ...

    def stats_now(self) -> dict[str, Any]: ...


def trajectory_of(request: Any) -> tuple[str, str] | None:
    """``(trajectory id, attempt)`` of a request under a trajectory's base URL
    (``/{trajectory_id}/{attempt}/...``), whether or not a route serves its path, so a valid key
    on a path the router does not serve is a 404, not an authentication error; ``None`` for
    ``/admin`` and paths with fewer segments."""
    info = request.match_info
    tid, attempt = info.get("tid"), info.get("attempt")
    if tid is None or attempt is None:
        parts = request.path.split("/")
        if len(parts) < 3 or not parts[1] or not parts[2]:
            return None
        tid, attempt = parts[1], parts[2]
    if tid == "admin":
        return None
    return tid, attempt


def build_app(router: ServedRouter) -> Any:
    """The aiohttp application of ``router`` (served by its :class:`~loongsage_core.http_server.ThreadedServer`)."""
    from aiohttp import web

    turns, registry = router.turns, router.registry

    def refuse(request: Any, token: str | None) -> Any:
        if token is None:
            raise RouterError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                              retry=False)
        named = trajectory_of(request)
        if named is not None:
            raise RouterError(401, f"invalid API key for trajectory '{named[0]}' attempt {named[1]}",
                              code="invalid_api_key", retry=False)
        raise RouterError(403, f"{request.method} {request.path} needs the run secret", code="forbidden",
                          retry=False)

    def own_key(request: Any, token: str) -> bool:
        named = trajectory_of(request)
        return named is not None and registry.key_opens(token, *named)

    @web.middleware
    async def errors(request: Any, handler: Any) -> Any:
        try:
            return await handler(request)
        except ConnectionError:  # the client went away mid-answer: nobody to tell, nothing to log
            log.debug("AgentFlow router: client of %s %s disconnected", request.method, request.path)
            return web.Response(status=499, reason="Client Closed Request")
        except RouterError as exc:
            turns.stats["errors"] += 1
            return json_response(error_response_body(request.path, exc, request.headers), exc.status, exc.headers())
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = f"{exc.reason}: {request.method} {request.path}"
            if exc.status == 413:
                message = (f"request body too large: the limit is {router.max_request_bytes} bytes "
                           "([agentflow] max_request_bytes)")
            http_err = RouterError(exc.status, message, code={404: "not_found", 413: "request_too_large"}
                                   .get(exc.status), retry=False)
            return json_response(error_response_body(request.path, http_err, request.headers), http_err.status,
                                 http_err.headers())
        except Exception as exc:  # a bug or a failing middleware: answer instead of dropping
            log.exception("AgentFlow router: unhandled error on %s", request.path)
            turns.stats["errors"] += 1
            bug = RouterError(500, f"internal router error: {type(exc).__name__}: {exc}", type="server_error",
                              retry=False)
            return json_response(error_response_body(request.path, bug, request.headers), 500, bug.headers())

    async def health(request: Any) -> Any:
        return json_response({"status": "ok"})

    async def stats(request: Any) -> Any:
        return json_response(router.stats_now())

    async def access_log(request: Any) -> Any:
        return json_response({"entries": router.access_log.entries()})

    async def base(request: Any) -> Any:
        """``GET``/``HEAD`` on a trajectory's base URL: 200 while it is live (clients probe it)."""
        record = turns.lookup(request).record
        return json_response({"trajectory_id": record.trajectory_id, "attempt": record.attempt,
                              "status": record.status.value})

    async def set_engines(request: Any) -> Any:
        body = await read_json(request)
        urls = body.get("urls") if isinstance(body, dict) else None
        if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
            raise bad_request("'urls' must be a non-empty list of engine URLs", param="urls")
        unknown = [u for u in urls if u.rstrip("/") not in router.known_engines]
        if unknown:
            raise RouterError(403, f"not an engine of this run: {', '.join(unknown)[:500]}; the router only "
                                   f"switches between engines the run launched", param="urls",
                              code="unknown_engine", retry=False)
        router.balancer.set_engines(urls)
        return json_response({"urls": router.balancer.urls})

    async def register(request: Any) -> Any:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        for key in body:
            if key not in REGISTER_FIELDS:
                raise bad_request(f"Unrecognized request argument supplied: {key}", param=key,
                                  code="unknown_parameter")
        attempt = body.get("attempt", 0)
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise bad_request("'attempt' must be a non-negative integer", param="attempt")
        if body.get("sampling") is not None and not isinstance(body["sampling"], dict):
            raise bad_request("'sampling' must be an object", param="sampling")
        try:
            tid = check_trajectory_id(body.get("trajectory_id"))
            registry.register(tid, attempt, body.get("sampling"), body.get("max_response_tokens"),
                              body.get("max_context_length"), body.get("metadata"), body.get("priority"))
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc)) from None
        return json_response({"trajectory_id": tid, "attempt": attempt, "base_url": router.url_for(tid, attempt),
                              "api_key": registry.key(tid, attempt)})

    async def get(request: Any) -> Any:
        return json_response(registry.admin_lookup(request.match_info["tid"]).record.to_dict())

    async def pop(request: Any) -> Any:
        tid = registry.admin_lookup(request.match_info["tid"]).record.trajectory_id
        return json_response(registry.pop(tid).to_dict())

    async def abort(request: Any) -> Any:
        tid = registry.admin_lookup(request.match_info["tid"]).record.trajectory_id
        registry.abort(tid)
        return json_response({"trajectory_id": tid, "status": "aborted"})

    app = web.Application(client_max_size=router.max_request_bytes, middlewares=[
        router.access_log.middleware(), errors, secret_middleware(router.secret, refuse, also_accepts=own_key)])
    openai_api.add_routes(app, turns)
    responses_api.add_routes(app, turns)
    anthropic_api.add_routes(app, turns)
    app.router.add_get("/health", health)
    app.router.add_get("/admin/stats", stats)
    app.router.add_post("/admin/engines", set_engines)
    app.router.add_post("/admin/trajectories", register)
    app.router.add_get("/admin/trajectories/{tid}", get)
    app.router.add_delete("/admin/trajectories/{tid}", pop)
    app.router.add_post("/admin/trajectories/{tid}/abort", abort)
    app.router.add_get("/admin/access_log", access_log)
    for path in ("/{tid}/{attempt}", "/{tid}/{attempt}/", "/{tid}/{attempt}/v1", "/{tid}/{attempt}/v1/"):
        app.router.add_get(path, base)  # HEAD too: clients probe their base URL
    return app
