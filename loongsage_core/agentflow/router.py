"""The AgentFlow router: an OpenAI-compatible HTTP server that records token-exact trajectories.

Each registered trajectory gets its own base URL ``{router}/{trajectory_id}/{attempt}/v1``. An
agent calls ``chat/completions`` there (OpenAI Chat Completions), ``responses`` (OpenAI Responses,
:mod:`.responses_api`) or ``messages`` (Anthropic Messages, :mod:`.anthropic_api`). Every protocol
is translated to one chat-completions turn (:meth:`AgentFlowRouter.run_turn`): the router renders
it to token ids (:mod:`.tito`), continues or starts a segment (:mod:`.conversation`), asks an
engine to generate from those ids (streaming tokens to the agent as they come when it asked for a
stream, :mod:`.streaming`), records the output tokens with their log-probs and weight versions,
and the protocol's adapter answers in its own format. Router middleware sees every request and
response, in chat-completions form, in the configured order.

The server runs on its own event loop in a background thread, so the same object works inside a
synchronous host, an asyncio host or a Ray actor: ``start()`` returns the base URL, the
trajectory API (``register``, ``get``, ``pop``, ``abort``) is callable from any thread (with
``a``-prefixed coroutine twins), and the same operations exist over HTTP under ``/admin``.

Security (:mod:`loongsage_core.security`): a router given the run's ``secret`` answers ``/health``
to anyone, ``/admin/*`` and every other path only to requests carrying the secret, and a
trajectory's endpoints (``/{trajectory_id}/{attempt}/...``, whatever the protocol) to the secret
or that attempt's own key (:meth:`AgentFlowRouter.trajectory_key`), so an agent can reach its own
endpoint and nothing else. The check is one aiohttp middleware, so routes added later are covered.
Request bodies and prompts are bounded (``max_request_bytes`` -> 413, ``max_prompt_chars`` -> 400,
both before any tokenization), chat templates and tokenization run on worker threads so one huge
request does not stall ``/health`` or other trajectories, and a client that disconnects has its
generation aborted at the engine without noise in the logs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import threading
import time
import uuid
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

import attrs

from loongsage_hookspecs import SamplingParams, TrajectoryStatus

from ..security import OPEN_PATHS, engine_headers, presented_token, token_matches
from ..security import trajectory_key as derive_trajectory_key
from . import anthropic_api, responses_api
from .access_log import AccessLog
from .conversation import ConversationTracker, TurnPlan
from .engines import EngineBalancer, EngineOutput, engine_abort, engine_generate, engine_generate_stream
from .errors import RouterError, bad_request, error_response_body, not_found
from .openai_api import ChatCompletionStream, ChatRequest, completion_body, new_completion_id, parse_chat_request
from .record import SamplingDefaults, TrajectoryRecord, TurnInfo, check_sampling
from .streaming import TextStreamer, as_router_error, cut_at_stop
from .tito import ChatRenderer, TemplateError

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""Largest request body the router reads (``[agentflow] max_request_bytes``); larger ones get a 413."""
DEFAULT_MAX_PROMPT_CHARS = 1_000_000
"""Most characters of message text (+ tool schemas) one request may carry (``[agentflow] max_prompt_chars``)."""


@attrs.define(eq=False)
class _Entry:
    """Live state of one registered trajectory (only touched on the router's event loop)."""

    record: TrajectoryRecord
    tracker: ConversationTracker
    sampling: SamplingDefaults
    lock: asyncio.Lock = attrs.field(factory=asyncio.Lock)
    in_flight: dict[str, str] = attrs.field(factory=dict)  # rid -> engine url
    aborted: bool = False
    protocol_state: dict[str, Any] = attrs.field(factory=dict)  # per-protocol stores (e.g. stored responses)


@attrs.define
class _Generation:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    engine: str = ""
    continuations: int = 0
    top_logprobs: list[list[tuple[float, int]]] | None = None
    content: str | None = None
    cached_tokens: int = 0


def _load_tokenizer(tokenizer: Any) -> Any:
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    return tokenizer


def check_trajectory_id(trajectory_id: Any) -> str:
    """A trajectory id must be a non-empty string usable as one URL path segment."""
    if not isinstance(trajectory_id, str) or not trajectory_id or "/" in trajectory_id or trajectory_id in (".", ".."):
        raise ValueError(f"trajectory id must be a non-empty string without '/', got {trajectory_id!r}")
    return trajectory_id


class AgentFlowRouter:
    """OpenAI-compatible router in front of one or more rollout engines.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template, or a path to load one from.
        engine_urls: base URLs of engines speaking SGLang's native API (``/generate``).
        middlewares: router middleware objects (``on_request`` / ``on_response``), applied in order.
        host, port: where to listen (port 0 picks a free port).
        model_name: the model id reported by ``GET /models`` and in responses.
        secret: the run secret. When set, ``/admin/*`` (and any path that is not a trajectory's)
            needs ``Authorization: Bearer <secret>``, a trajectory's endpoints accept the secret or
            :meth:`trajectory_key`, and requests to engines carry it. ``None``: no authentication
            (a router embedded in a test or a user's own process).
        max_request_bytes: largest request body (413 beyond it).
        max_prompt_chars: most characters of message text and tool schemas per request (400 beyond it).
        render_threads: worker threads that render chat templates and tokenize.
        default_sampling: sampling defaults for trajectories registered without their own.
        max_context_length: default per-segment token limit (prompt + generation).
        engine_timeout_s: limit for one ``/generate`` call.
        max_continuations: how often one turn may be resumed after the engine aborted it (weight
            updates with partial rollouts); the tokens generated so far are kept.
        chat_template, turn_end_ids: override the tokenizer's template / turn-end tokens.
        access_log_path: also append every request's access-log line (JSON) to this file.

    Stop strings go to the engine (``sampling_params.stop``, which SGLang and the embedded engine
    honour): the turn ends at the token that completes one, and the content ends before it.
    ``top_logprobs`` is forwarded as SGLang's ``top_logprobs_num``.
    """

    def __init__(self, tokenizer: Any, engine_urls: Sequence[str], middlewares: Sequence[Any] = (), *,
                 host: str = "127.0.0.1", port: int = 0, model_name: str = "policy", secret: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
                 render_threads: int = 4,
                 default_sampling: Mapping[str, Any] | None = None, max_context_length: int | None = None,
                 engine_timeout_s: float = 600.0, max_continuations: int = 8, chat_template: str | None = None,
                 turn_end_ids: Sequence[int] | None = None, access_log_path: str | None = None) -> None:
        self.tokenizer = _load_tokenizer(tokenizer)
        self.renderer = ChatRenderer(self.tokenizer, chat_template=chat_template, turn_end_ids=turn_end_ids)
        self.balancer = EngineBalancer(engine_urls)
        self.known_engines: set[str] = set(self.balancer.urls)  # what /admin/engines may switch to
        for i, mw in enumerate(middlewares):
            if not (callable(getattr(mw, "on_request", None)) and callable(getattr(mw, "on_response", None))):
                raise TypeError(f"middleware #{i} ({type(mw).__name__}) lacks on_request/on_response")
        self.middlewares = list(middlewares)
        self.host, self.port = host, port
        self.model_name = model_name
        self.secret = secret
        for name, value in (("max_request_bytes", max_request_bytes), ("max_prompt_chars", max_prompt_chars),
                            ("render_threads", render_threads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AgentFlowRouter: {name} must be a positive integer, got {value!r}")
        self.max_request_bytes = max_request_bytes
        self.max_prompt_chars = max_prompt_chars
        self._render_pool = concurrent.futures.ThreadPoolExecutor(max_workers=render_threads,
                                                                  thread_name_prefix="agentflow-render")
        self.default_sampling = dict(default_sampling or {})
        self.max_context_length = max_context_length
        self.engine_timeout_s = engine_timeout_s
        self.max_continuations = max_continuations
        self.access_log = AccessLog(access_log_path)
        self.base_url: str | None = None
        self._entries: dict[str, _Entry] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None
        self._session: Any = None
        self._engine_ctx: dict[str, int | None] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._stats = {"requests": 0, "errors": 0, "engine_calls": 0, "completion_tokens": 0}

    # ------------------------------------------------------------------------ life cycle
    def start(self, timeout_s: float = 30.0) -> str:
        """Start serving in a background thread; returns the base URL ``http://HOST:PORT``."""
        if self._thread is not None:
            assert self.base_url is not None
            return self.base_url
        ready: concurrent.futures.Future[str] = concurrent.futures.Future()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                ready.set_result(loop.run_until_complete(self._astart()))
            except BaseException as exc:  # report startup failures to the caller
                ready.set_exception(exc)
                loop.close()
                return
            loop.run_forever()
            loop.run_until_complete(self._astop())
            loop.close()

        self._thread = threading.Thread(target=serve, name="agentflow-router", daemon=True)
        self._thread.start()
        try:
            return ready.result(timeout=timeout_s)
        except BaseException:
            self._thread = None
            raise

    async def _astart(self) -> str:
        import aiohttp
        from aiohttp import web

        app = web.Application(client_max_size=self.max_request_bytes,
                              middlewares=[self.access_log.middleware(), self._error_middleware])
        app.router.add_post("/{tid}/{attempt}/v1/chat/completions", self._handle_chat)
        app.router.add_get("/{tid}/{attempt}/v1/models", self._handle_models)
        responses_api.add_routes(app, self)
        anthropic_api.add_routes(app, self)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/admin/stats", self._handle_stats)
        app.router.add_post("/admin/engines", self._handle_set_engines)
        app.router.add_post("/admin/trajectories", self._handle_register)
        app.router.add_get("/admin/trajectories/{tid}", self._handle_get)
        app.router.add_delete("/admin/trajectories/{tid}", self._handle_pop)
        app.router.add_post("/admin/trajectories/{tid}/abort", self._handle_abort)
        app.router.add_get("/admin/access_log", self._handle_access_log)
        for base in ("/{tid}/{attempt}", "/{tid}/{attempt}/", "/{tid}/{attempt}/v1", "/{tid}/{attempt}/v1/"):
            app.router.add_get(base, self._handle_base)  # HEAD too: clients probe their base URL
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              headers=engine_headers(self.secret))
        # a client that goes away cancels its handler: the generation is aborted at the engine
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])  # the bound port when port=0
        self.base_url = f"http://{self.host}:{self.port}"
        return self.base_url

    async def _astop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def shutdown(self) -> None:
        """Stop serving and join the server thread (idempotent)."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        self._thread = None
        self._loop = None
        self._render_pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "AgentFlowRouter":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _call(self, coro: Awaitable[T], timeout_s: float = 60.0) -> T:
        """Run ``coro`` on the router loop from another thread and wait for it."""
        if self._loop is None:
            raise RuntimeError("AgentFlowRouter is not started; call start() first")
        if threading.current_thread() is self._thread:
            raise RuntimeError("synchronous router API called on the router thread; use the a* coroutines")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)  # type: ignore[arg-type]

    async def _on_loop(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the router loop from any event loop (or directly when already on it)."""
        if self._loop is None:
            raise RuntimeError("AgentFlowRouter is not started; call start() first")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return fn()

        async def run() -> T:
            return fn()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self._loop))

    # ------------------------------------------------------------------------ trajectory API
    def url_for(self, trajectory_id: str, attempt: int = 0) -> str:
        """The OpenAI base URL of a trajectory: ``{router}/{trajectory_id}/{attempt}/v1``."""
        if self.base_url is None:
            raise RuntimeError("AgentFlowRouter is not started; call start() first")
        return f"{self.base_url}/{check_trajectory_id(trajectory_id)}/{int(attempt)}/v1"

    def trajectory_key(self, trajectory_id: str, attempt: int = 0) -> str:
        """The API key an agent sends for this trajectory attempt (only valid on its own endpoint).

        Without a run secret the router checks no keys and any placeholder works.
        """
        if self.secret is None:
            return "loongsage"
        return derive_trajectory_key(self.secret, check_trajectory_id(trajectory_id), attempt)

    def _register(self, trajectory_id: str, attempt: int, sampling: Mapping[str, Any] | SamplingParams | None,
                  max_response_tokens: int | None, max_context_length: int | None,
                  metadata: Mapping[str, Any] | None) -> str:
        check_trajectory_id(trajectory_id)
        if isinstance(sampling, SamplingParams):
            sampling = attrs.asdict(sampling)
        merged = {**self.default_sampling, **dict(sampling or {})}
        check_sampling(merged)
        for name, value in (("max_response_tokens", max_response_tokens), ("max_context_length", max_context_length)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        old = self._entries.get(trajectory_id)
        if old is not None:
            self._abort_entry(old)
        record = TrajectoryRecord(trajectory_id=trajectory_id, attempt=int(attempt),
                                  max_response_tokens=max_response_tokens,
                                  max_context_length=max_context_length if max_context_length is not None
                                  else self.max_context_length, metadata=dict(metadata or {}))
        self._entries[trajectory_id] = _Entry(record, ConversationTracker(self.renderer, record.segments),
                                              SamplingDefaults.from_dict(merged))
        return self.url_for(trajectory_id, attempt)

    def register(self, trajectory_id: str, *, attempt: int = 0,
                 sampling: Mapping[str, Any] | SamplingParams | None = None, max_response_tokens: int | None = None,
                 max_context_length: int | None = None, metadata: Mapping[str, Any] | None = None) -> str:
        """Register a trajectory and return its OpenAI base URL.

        ``sampling`` holds defaults in SGLang names (``temperature``, ``top_p``, ``top_k``,
        ``max_new_tokens``, ``seed``, ``stop_token_ids``; ``locked=True`` makes them override the
        request). ``max_response_tokens`` caps the generated tokens over all turns,
        ``max_context_length`` the tokens of a segment; a turn that hits either ends with
        ``finish_reason="length"``. Registering an id again (a retry, usually with
        ``attempt + 1``) aborts and replaces the old record; requests to the old attempt get 404.
        """
        return self._call(self._async(lambda: self._register(trajectory_id, attempt, sampling, max_response_tokens,
                                                             max_context_length, metadata)))

    async def aregister(self, trajectory_id: str, *, attempt: int = 0,
                        sampling: Mapping[str, Any] | SamplingParams | None = None,
                        max_response_tokens: int | None = None, max_context_length: int | None = None,
                        metadata: Mapping[str, Any] | None = None) -> str:
        """Coroutine form of :meth:`register`."""
        return await self._on_loop(lambda: self._register(trajectory_id, attempt, sampling, max_response_tokens,
                                                          max_context_length, metadata))

    def _entry(self, trajectory_id: str) -> _Entry:
        entry = self._entries.get(trajectory_id)
        if entry is None:
            raise KeyError(f"unknown trajectory {trajectory_id!r}")
        return entry

    def _snapshot(self, trajectory_id: str) -> TrajectoryRecord:
        return TrajectoryRecord.from_dict(self._entry(trajectory_id).record.to_dict())

    def get(self, trajectory_id: str) -> TrajectoryRecord:
        """A copy of the trajectory's record as it stands (KeyError if unknown)."""
        return self._call(self._async(lambda: self._snapshot(trajectory_id)))

    async def aget(self, trajectory_id: str) -> TrajectoryRecord:
        return await self._on_loop(lambda: self._snapshot(trajectory_id))

    def _pop(self, trajectory_id: str) -> TrajectoryRecord:
        entry = self._entry(trajectory_id)
        self._abort_entry(entry, status=None)  # a turn still generating is never recorded
        del self._entries[trajectory_id]
        self.balancer.forget(trajectory_id)
        return entry.record

    def pop(self, trajectory_id: str) -> TrajectoryRecord:
        """Remove the trajectory and return its record; later requests to it get 404.

        A request still in flight is aborted at the engine and never recorded.
        """
        return self._call(self._async(lambda: self._pop(trajectory_id)))

    async def apop(self, trajectory_id: str) -> TrajectoryRecord:
        return await self._on_loop(lambda: self._pop(trajectory_id))

    def _abort_entry(self, entry: _Entry, status: TrajectoryStatus | None = TrajectoryStatus.ABORTED) -> None:
        entry.aborted = True
        if status is not None:
            entry.record.status = status
        for rid, url in list(entry.in_flight.items()):
            task = asyncio.get_running_loop().create_task(engine_abort(self._session, url, rid))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _abort(self, trajectory_id: str) -> None:
        self._abort_entry(self._entry(trajectory_id))

    def abort(self, trajectory_id: str) -> None:
        """Mark the trajectory aborted, abort its in-flight generation; later calls get 409."""
        self._call(self._async(lambda: self._abort(trajectory_id)))

    async def aabort(self, trajectory_id: str) -> None:
        await self._on_loop(lambda: self._abort(trajectory_id))

    def _set_engines(self, urls: Sequence[str]) -> None:
        self.balancer.set_engines(urls)
        self.known_engines.update(self.balancer.urls)

    def set_engines(self, urls: Sequence[str]) -> None:
        """Replace the engine list (e.g. after engines restarted). Only this Python API may add
        engines the router has not seen; ``POST /admin/engines`` chooses among known ones."""
        self._call(self._async(lambda: self._set_engines(urls)))

    def stats(self) -> dict[str, Any]:
        """Counters: requests, errors, engine calls, generated tokens, live trajectories, load."""
        return self._call(self._async(self._stats_now))

    def _stats_now(self) -> dict[str, Any]:
        return {**self._stats, "trajectories": len(self._entries), "in_flight": dict(self.balancer.in_flight)}

    @staticmethod
    async def _async(fn: Callable[[], T]) -> T:
        return fn()

    # ------------------------------------------------------------------------ HTTP plumbing
    @staticmethod
    def _json(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Any:
        from aiohttp import web

        return web.Response(body=json.dumps(body).encode(), status=status, content_type="application/json",
                            headers=headers)

    @property
    def _error_middleware(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def errors(request: Any, handler: Any) -> Any:
            try:
                self._authorize(request)
                return await handler(request)
            except ConnectionError:  # the client went away mid-answer: nobody to tell, nothing to log
                log.debug("AgentFlow router: client of %s %s disconnected", request.method, request.path)
                return web.Response(status=499, reason="Client Closed Request")
            except RouterError as exc:
                self._stats["errors"] += 1
                return self._json(error_response_body(request.path, exc), exc.status, exc.headers())
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                message = f"{exc.reason}: {request.method} {request.path}"
                if exc.status == 413:
                    message = (f"request body too large: the limit is {self.max_request_bytes} bytes "
                               "([agentflow] max_request_bytes)")
                http_err = RouterError(exc.status, message, code={404: "not_found", 413: "request_too_large"}
                                       .get(exc.status), retry=False)
                return self._json(error_response_body(request.path, http_err), http_err.status, http_err.headers())
            except Exception as exc:  # a bug or a failing middleware: answer instead of dropping
                log.exception("AgentFlow router: unhandled error on %s", request.path)
                self._stats["errors"] += 1
                bug = RouterError(500, f"internal router error: {type(exc).__name__}: {exc}", type="server_error",
                                  retry=False)
                return self._json(error_response_body(request.path, bug), 500, bug.headers())

        return errors

    def _authorize(self, request: Any) -> None:
        """Check the request's credential for its path (see the module docstring); raise 401/403."""
        if self.secret is None or request.path in OPEN_PATHS:
            return
        token = presented_token(request.headers)
        if token_matches(token, self.secret):
            return
        info = request.match_info
        tid, attempt = info.get("tid"), info.get("attempt")
        own_endpoint = tid is not None and attempt is not None and not request.path.startswith("/admin/")
        if token is None:
            raise RouterError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                              retry=False)
        if own_endpoint and attempt.isdigit() and token_matches(token, derive_trajectory_key(
                self.secret, tid, int(attempt))):
            return
        if own_endpoint:
            raise RouterError(401, f"invalid API key for trajectory '{tid}' attempt {attempt}",
                              code="invalid_api_key", retry=False)
        raise RouterError(403, f"{request.method} {request.path} needs the run secret", code="forbidden",
                          retry=False)

    @staticmethod
    async def _read_json(request: Any) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise bad_request("We could not parse the JSON body of your request: it is not valid JSON.",
                              code="invalid_json") from None

    def _lookup(self, request: Any) -> _Entry:
        tid = request.match_info["tid"]
        attempt = request.match_info["attempt"]
        entry = self._entries.get(tid)
        if entry is None:
            raise not_found(f"unknown trajectory '{tid}' (not registered, or already collected)",
                            code="trajectory_not_found")
        if attempt != str(entry.record.attempt):
            raise not_found(f"trajectory '{tid}' has no attempt {attempt} (current attempt: "
                            f"{entry.record.attempt})", code="stale_attempt")
        return entry

    async def _handle_health(self, request: Any) -> Any:
        return self._json({"status": "ok"})

    async def _handle_stats(self, request: Any) -> Any:
        return self._json(self._stats_now())

    async def _handle_access_log(self, request: Any) -> Any:
        return self._json({"entries": self.access_log.entries()})

    async def _handle_base(self, request: Any) -> Any:
        """``GET``/``HEAD`` on a trajectory's base URL: 200 while it is live (clients probe it)."""
        entry = self._lookup(request)
        return self._json({"trajectory_id": entry.record.trajectory_id, "attempt": entry.record.attempt,
                           "status": entry.record.status.value})

    async def _handle_models(self, request: Any) -> Any:
        self._lookup(request)
        return self._json({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "loongsage"}]})

    async def _handle_set_engines(self, request: Any) -> Any:
        body = await self._read_json(request)
        urls = body.get("urls") if isinstance(body, dict) else None
        if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
            raise bad_request("'urls' must be a non-empty list of engine URLs", param="urls")
        unknown = [u for u in urls if u.rstrip("/") not in self.known_engines]
        if unknown:
            raise RouterError(403, f"not an engine of this run: {', '.join(unknown)[:500]}; the router only "
                                   f"switches between engines the run launched", param="urls",
                              code="unknown_engine", retry=False)
        self.balancer.set_engines(urls)
        return self._json({"urls": self.balancer.urls})

    async def _handle_register(self, request: Any) -> Any:
        body = await self._read_json(request)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        allowed = {"trajectory_id", "attempt", "sampling", "max_response_tokens", "max_context_length", "metadata"}
        for key in body:
            if key not in allowed:
                raise bad_request(f"Unrecognized request argument supplied: {key}", param=key,
                                  code="unknown_parameter")
        attempt = body.get("attempt", 0)
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise bad_request("'attempt' must be a non-negative integer", param="attempt")
        if body.get("sampling") is not None and not isinstance(body["sampling"], dict):
            raise bad_request("'sampling' must be an object", param="sampling")
        try:
            url = self._register(check_trajectory_id(body.get("trajectory_id")), attempt, body.get("sampling"),
                                 body.get("max_response_tokens"), body.get("max_context_length"),
                                 body.get("metadata"))
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc)) from None
        return self._json({"trajectory_id": body["trajectory_id"], "attempt": attempt, "base_url": url,
                           "api_key": self.trajectory_key(body["trajectory_id"], attempt)})

    def _admin_entry(self, request: Any) -> str:
        tid = request.match_info["tid"]
        if tid not in self._entries:
            raise not_found(f"unknown trajectory '{tid}'", code="trajectory_not_found")
        return tid

    async def _handle_get(self, request: Any) -> Any:
        return self._json(self._entries[self._admin_entry(request)].record.to_dict())

    async def _handle_pop(self, request: Any) -> Any:
        return self._json(self._pop(self._admin_entry(request)).to_dict())

    async def _handle_abort(self, request: Any) -> Any:
        self._abort(self._admin_entry(request))
        return self._json({"trajectory_id": request.match_info["tid"], "status": "aborted"})

    # ------------------------------------------------------------------------ turns (every protocol)
    async def _handle_chat(self, request: Any) -> Any:
        self._lookup(request)
        body = await self._read_json(request)
        parse_chat_request(body)  # a stream starts only for a valid request
        stream = ChatCompletionStream(request, body) if isinstance(body, dict) and body.get("stream") else None
        try:
            req, response = await self.run_turn(request, body, stream)
        except Exception as exc:  # after the stream started, errors are reported in it
            if stream is None or not stream.started or isinstance(exc, ConnectionResetError):
                raise
            return await stream.fail(as_router_error(exc))
        if stream is not None:
            return await stream.finish(response)
        return self._json(response)

    async def run_turn(self, request: Any, body: Any, stream: Any = None) -> tuple[ChatRequest, dict[str, Any]]:
        """Serve one model turn of the trajectory that ``request``'s URL names; any protocol.

        ``body`` is a chat-completions request (protocol adapters translate theirs into one).
        Request middleware runs, the turn is planned, generated and recorded, response middleware
        runs; returns the validated request and the ``chat.completion`` answer. With ``stream``
        (an object with ``async start(*, prompt_tokens, model)`` and ``async delta(increments)``,
        see :class:`~.openai_api.ChatCompletionStream`), ``start`` is awaited once the turn is
        accepted (errors before it are ordinary error answers) and ``delta`` with each piece of
        new text (``{"content": ..., "reasoning_content": ...}``) as tokens arrive from the
        engine, the last piece before this returns.
        """
        self._stats["requests"] += 1
        entry = self._lookup(request)
        tid = entry.record.trajectory_id
        parse_chat_request(body)  # middleware sees only valid requests
        for mw in self.middlewares:
            body = mw.on_request(tid, body)
            if not isinstance(body, dict):
                raise RouterError(500, f"middleware {type(mw).__name__}.on_request returned "
                                       f"{type(body).__name__}, expected a dict", type="server_error")
        req = parse_chat_request(body)
        async with entry.lock:
            if entry.aborted:
                raise RouterError(409, f"trajectory '{tid}' was aborted", code="trajectory_aborted", retry=False)
            if self._entries.get(tid) is not entry:
                raise not_found(f"unknown trajectory '{tid}'", code="trajectory_not_found")
            response = await self._complete(entry, req, body, stream)
        return req, response

    def protocol_state(self, request: Any, protocol: str) -> dict[str, Any]:
        """A dict that lives as long as the trajectory ``request`` names, for one protocol's own state."""
        return self._lookup(request).protocol_state.setdefault(protocol, {})

    async def count_prompt_tokens(self, request: Any, body: Any) -> int:
        """Tokens the chat-completions ``body`` would send to the engine (nothing is recorded)."""
        entry = self._lookup(request)
        req = parse_chat_request(body)
        return len((await self._plan(entry, req.messages, req.tools, req.chat_template_kwargs)).context)

    def _sampling(self, entry: _Entry, req: ChatRequest, max_new: int) -> dict[str, Any]:
        """SGLang ``sampling_params`` for this turn: request values over the registered defaults.

        The registered seed is varied per turn (turn 0 uses it as is), so the turns of one
        trajectory do not share a random stream; a seed the request sets is used unchanged.
        """
        d = entry.sampling

        def pick(value: Any, default: Any) -> Any:
            return default if value is None or d.locked else value

        seed = pick(req.seed, None)
        if seed is None and d.seed is not None:
            seed = (d.seed + len(entry.record.turns) * 0x9E3779B1) % 2**31

        params = SamplingParams(
            temperature=float(pick(req.temperature, d.temperature)),
            top_p=float(pick(req.top_p, d.top_p)),
            top_k=int(pick(req.top_k, d.top_k)),
            max_new_tokens=max_new,
            stop_token_ids=list(dict.fromkeys([*self.renderer.turn_end_ids, *d.stop_token_ids])),
            seed=seed,
        ).to_sglang()
        params.update(d.extra)
        for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(req, name)
            if value is not None and not d.locked:
                params[name] = value
        if req.stop:
            params["stop"] = list(req.stop)
        return params

    async def _engine_context(self, url: str) -> int | None:
        """The engine's context length (``/get_model_info``, else ``/get_server_info``), cached."""
        if url in self._engine_ctx:
            return self._engine_ctx[url]
        import aiohttp

        found: int | None = None
        for path, keys in (("/get_model_info", ("max_context_length", "context_length")),
                           ("/get_server_info", ("context_length", "max_context_length"))):
            try:
                async with self._session.get(url + path, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    info = await resp.json() if resp.status == 200 else {}
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                return None  # unreachable now: ask again next time
            values = [info.get(k) for k in keys if isinstance(info, dict)]
            found = next((int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)
            if found is not None:
                break
        self._engine_ctx[url] = found
        return found

    def _max_new(self, entry: _Entry, req: ChatRequest, plan: TurnPlan, engine_ctx: int | None) -> int:
        d = entry.sampling
        wanted = d.max_new_tokens if req.max_tokens is None else (
            min(req.max_tokens, d.max_new_tokens) if d.locked else req.max_tokens)
        rec = entry.record
        if rec.max_response_tokens is not None:
            wanted = min(wanted, rec.max_response_tokens - rec.response_tokens)
        if rec.max_context_length is not None:
            wanted = min(wanted, rec.max_context_length - len(plan.context))
        if engine_ctx is not None:
            wanted = min(wanted, engine_ctx - len(plan.context) - 1)
        return max(0, wanted)

    async def _generate(self, entry: _Entry, plan: TurnPlan, req: ChatRequest, max_new: int,
                        on_tokens: Callable[[list[int]], Awaitable[None]] | None = None) -> _Generation:
        """Generate one turn, resuming after engine aborts (weight updates) up to a limit.

        With ``on_tokens`` the engine streams, and ``on_tokens`` gets all tokens of the turn so
        far after every engine update.
        """
        tid = entry.record.trajectory_id
        url = self.balancer.pick(tid)
        gen = _Generation([], [], [], "length", engine=url, top_logprobs=[] if req.top_logprobs else None)
        turn = len(entry.record.turns)
        while True:
            remaining = max_new - len(gen.ids)
            rid = f"{tid}-{entry.record.attempt}-{turn}-{gen.continuations}-{uuid.uuid4().hex[:8]}"
            payload: dict[str, Any] = {"input_ids": plan.context + gen.ids,
                                       "sampling_params": self._sampling(entry, req, remaining),
                                       "return_logprob": True, "rid": rid}
            if req.top_logprobs:
                payload["top_logprobs_num"] = req.top_logprobs
            entry.in_flight[rid] = url
            self.balancer.acquire(url)
            self._stats["engine_calls"] += 1
            try:
                if on_tokens is None:
                    out: EngineOutput = await engine_generate(self._session, url, payload, self.engine_timeout_s)
                else:
                    out = await self._generate_streaming(url, payload, gen.ids, on_tokens)
            except BaseException:  # the client went away or the stream broke: free the engine
                await asyncio.shield(engine_abort(self._session, url, rid))
                raise
            finally:
                entry.in_flight.pop(rid, None)
                self.balancer.release(url)
            gen.ids += out.output_ids
            gen.logprobs += out.logprobs
            gen.versions += out.weight_versions
            gen.cached_tokens += out.cached_tokens
            if gen.top_logprobs is not None:
                gen.top_logprobs += out.top_logprobs or [[] for _ in out.output_ids]
            if entry.aborted:
                raise RouterError(409, f"trajectory '{tid}' was aborted", code="trajectory_aborted", retry=False)
            if out.finish_reason != "abort":
                gen.finish_reason = "length" if out.finish_reason == "length" else "stop"
                return gen
            if len(gen.ids) >= max_new:
                gen.finish_reason = "length"
                return gen
            gen.continuations += 1
            if gen.continuations > self.max_continuations:
                raise RouterError(503, f"engine {url} aborted the generation {gen.continuations} times",
                                  type="api_error", code="engine_aborted", retry=False)
            await asyncio.sleep(min(0.05 * gen.continuations, 1.0))
            url = self.balancer.pick(tid)

    async def _generate_streaming(self, url: str, payload: dict[str, Any], before: list[int],
                                  on_tokens: Callable[[list[int]], Awaitable[None]]) -> EngineOutput:
        """One streamed engine call; ``before`` are the turn's tokens from earlier (aborted) calls."""
        out: EngineOutput | None = None
        seen = 0
        async for out in engine_generate_stream(self._session, url, payload, self.engine_timeout_s):
            if len(out.output_ids) > seen:
                seen = len(out.output_ids)
                await on_tokens(before + out.output_ids)
        assert out is not None  # engine_generate_stream raises when nothing finished
        return out

    def _logprobs_body(self, gen: _Generation) -> dict[str, Any]:
        ids = gen.ids
        if ids and ids[-1] in self.renderer.turn_end_ids:
            ids = ids[:-1]
        content = []
        for i, tok in enumerate(ids):
            text = self.renderer.decode([tok])
            tops = []
            for lp, tid in (gen.top_logprobs[i] if gen.top_logprobs else []):
                t = self.renderer.decode([tid])
                tops.append({"token": t, "logprob": lp, "bytes": list(t.encode())})
            content.append({"token": text, "logprob": gen.logprobs[i], "bytes": list(text.encode()),
                            "top_logprobs": tops})
        return {"content": content, "refusal": None}

    def _context_limit(self, entry: _Entry, plan: TurnPlan, engine_ctx: int | None) -> None:
        """A prompt that leaves no room to generate is a 400 ``context_length_exceeded``; the
        trajectory is marked failed (its agent cannot go on as it is)."""
        # the same room _max_new computes: the engine needs one position beyond the prompt
        limits = [n for n in (entry.record.max_context_length, None if engine_ctx is None else engine_ctx - 1)
                  if n is not None]
        if not limits or len(plan.context) < min(limits):
            return
        limit = min(limits)
        if engine_ctx is not None and limit == engine_ctx - 1:
            limit = engine_ctx
        message = (f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
                   f"{len(plan.context)} tokens. Please reduce the length of the messages.")
        entry.record.status = TrajectoryStatus.FAILED
        entry.record.error = f"context_length_exceeded: {message}"
        entry.record.finish_reason = "context_length_exceeded"
        raise bad_request(message, param="messages", code="context_length_exceeded")

    async def _complete(self, entry: _Entry, req: ChatRequest, body: dict[str, Any],
                        stream: Any = None) -> dict[str, Any]:
        """Plan, generate, run response middleware, commit: one turn."""
        rec = entry.record
        started = time.perf_counter()
        plan = await self._plan(entry, req.messages, req.tools, req.chat_template_kwargs)
        engine_ctx = await self._engine_context(self.balancer.pick(rec.trajectory_id))
        self._context_limit(entry, plan, engine_ctx)
        max_new = self._max_new(entry, req, plan, engine_ctx)
        streamer = None
        if stream is not None:
            await stream.start(prompt_tokens=len(plan.context), model=req.model or self.model_name)
            streamer = TextStreamer(self.renderer.content_of, self.middlewares, rec.trajectory_id, body, req.stop)

        async def on_tokens(ids: list[int]) -> None:
            assert streamer is not None
            increments = streamer.update(ids)
            if increments:
                await stream.delta(increments)

        if max_new > 0:
            rec.status = TrajectoryStatus.GENERATING
            gen = await self._generate(entry, plan, req, max_new, on_tokens if streamer is not None else None)
            gen.content, matched_stop = cut_at_stop(self.renderer.content_of(gen.ids), req.stop)
            if matched_stop is not None:
                gen.finish_reason = "stop"
        else:  # a budget is spent: end the turn without generating
            gen, matched_stop = _Generation([], [], [], "length", content=""), None
        response = completion_body(
            completion_id=new_completion_id(), model=req.model or self.model_name,
            message={"role": "assistant", "content": gen.content}, finish_reason=gen.finish_reason,
            prompt_tokens=len(plan.context), completion_tokens=len(gen.ids),
            logprobs=self._logprobs_body(gen) if req.logprobs else None)
        if matched_stop is not None:
            response["choices"][0]["matched_stop"] = matched_stop  # as SGLang reports it
        for mw in self.middlewares:
            response = mw.on_response(rec.trajectory_id, body, response)
            if not isinstance(response, dict):
                raise RouterError(500, f"middleware {type(mw).__name__}.on_response returned "
                                       f"{type(response).__name__}, expected a dict", type="server_error")
        message = response["choices"][0]["message"]
        if max_new > 0:
            entry.tracker.commit(plan, gen.ids, gen.logprobs, gen.versions, message)
            versions = [v for v in gen.versions if v >= 0] or [-1]
            rec.turns.append(TurnInfo(segment=plan.segment_index, prompt_tokens=len(plan.context),
                                      new_prompt_tokens=len(plan.delta), completion_tokens=len(gen.ids),
                                      finish_reason=gen.finish_reason, weight_versions=(min(versions), max(versions)),
                                      engine=gen.engine, latency_s=time.perf_counter() - started,
                                      continuations=gen.continuations, new_segment=plan.new_segment,
                                      cached_tokens=gen.cached_tokens))
            self._stats["completion_tokens"] += len(gen.ids)
        rec.messages = plan.messages + [dict(message)]
        rec.finish_reason = response["choices"][0]["finish_reason"]
        if streamer is not None:
            rest = streamer.finish(message)  # what the stream has not shown yet of the final message
            if rest:
                await stream.delta(rest)
        return response

    def check_prompt_size(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> None:
        """Refuse (400) a conversation whose text exceeds ``max_prompt_chars``, before rendering it.

        Counts every string in the messages (content, tool-call arguments, names) and the tool
        schemas as JSON; protocol adapters call it through :meth:`_plan`.
        """
        total = len(json.dumps(tools, ensure_ascii=False, default=str)) if tools else 0

        def count(value: Any) -> int:
            if isinstance(value, str):
                return len(value)
            if isinstance(value, Mapping):
                return sum(count(v) for v in value.values())
            if isinstance(value, (list, tuple)):
                return sum(count(v) for v in value)
            return 0

        for message in messages:
            total += count(message)
            if total > self.max_prompt_chars:
                break
        if total > self.max_prompt_chars:
            raise bad_request(f"the conversation has more than {self.max_prompt_chars} characters of text "
                              "([agentflow] max_prompt_chars); shorten or compact it", param="messages",
                              code="prompt_too_long")

    async def _plan(self, entry: _Entry, messages: Sequence[Mapping[str, Any]], tools: Any,
                    template_kwargs: Mapping[str, Any] | None) -> TurnPlan:
        """The turn plan, rendered and tokenized on a worker thread after the size check."""
        self.check_prompt_size(messages, tools)
        work = functools.partial(entry.tracker.plan, messages, tools, template_kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._render_pool, work)
        except TemplateError as exc:
            raise bad_request(str(exc), param="messages", code="chat_template_error") from None
