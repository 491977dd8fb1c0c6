"""The AgentFlow router: an OpenAI-compatible HTTP server that records token-exact trajectories.

Each registered trajectory gets its own base URL ``{router}/{trajectory_id}/{attempt}/v1``. An
agent calls ``chat/completions`` there (OpenAI Chat Completions, :mod:`.openai_api`),
``responses`` (OpenAI Responses, :mod:`.responses_api`) or ``messages`` (Anthropic Messages,
:mod:`.anthropic_api`). Every protocol is translated to one chat-completions turn
(:mod:`.turns`): the router renders it to token ids (:mod:`.tito`), continues or starts a segment
(:mod:`.conversation`), asks an engine to generate from those ids within the sampling policy
(:mod:`.sampling`), streaming tokens to the agent as they come when it asked for a stream
(:mod:`.streaming`), records the output tokens with their log-probs and weight versions, and the
protocol's adapter answers in its own format. Router middleware sees every request and response,
in chat-completions form, in the configured order.

The parts: :mod:`.registry` (live trajectories, keys, aborts), :mod:`.turns` (one turn),
:mod:`.sampling` (the sampling policy), :mod:`.app` (routes, admin API, authentication, error
answers) and this module, which ties them together and serves the application from a background
thread (:class:`~loongsage_core.http_server.ThreadedServer`), so the same object works inside a
synchronous host, an asyncio host or a Ray actor: ``start()`` returns the base URL, the
trajectory API is coroutines (``aregister``, ``aget``, ``apop``, ``aabort``, ``aset_engines``,
``astats``) callable from any event loop, and synchronous code calls them through
:attr:`AgentFlowRouter.blocking` (``router.blocking.register(...)``). The same operations exist
over HTTP under ``/admin``.

Security (:mod:`loongsage_core.security`, :mod:`.app`): a router given the run's ``secret``
answers ``/health`` to anyone, ``/admin/*`` and every other path only to requests carrying the
secret, and a trajectory's endpoints to the secret or that attempt's own key
(:meth:`AgentFlowRouter.trajectory_key`). Request bodies and prompts are bounded
(``max_request_bytes`` -> 413, ``max_prompt_chars`` -> 400, both before any tokenization), chat
templates and tokenization run on worker threads so one huge request does not stall ``/health``
or other trajectories, and a client that disconnects has its generation aborted at the engine
without noise in the logs.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Mapping, Sequence

from loongsage_hookspecs import RouterMiddleware, SamplingParams

from ..http_server import BlockingView, ThreadedServer
from .access_log import AccessLog
from .app import build_app
from .engines import EngineBalancer, EnginePool
from .images import ImageInputs, ImageLimits
from .record import TrajectoryRecord
from .registry import TrajectoryRegistry, check_trajectory_id
from .tito import ChatRenderer
from .turns import TurnLimits, TurnRunner

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""Largest request body the router reads (``[agentflow] max_request_bytes``); larger ones get a 413."""
DEFAULT_MAX_PROMPT_CHARS = 1_000_000
"""Most characters of message text (+ tool schemas) one request may carry (``[agentflow] max_prompt_chars``)."""


def _load_tokenizer(tokenizer: Any) -> Any:
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    return tokenizer


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
        on_engine_lost: called (on the router's event loop, must not block) with an engine's URL
            when a request could not reach it; the host may replace the engine and then tell the
            router with :meth:`aset_engines`.
        engine_retries: how often one turn is sent again after its engine could not be reached
            (default 0: the agent gets a 503). The engine is marked down until the engine list is
            set again; the turn goes to another engine that is up, or waits up to
            ``engine_wait_s`` for one. Nothing of the failed call is recorded (a streamed turn
            keeps the tokens the agent was already shown, as after an abort), so the turn's
            record stays token-exact.
        image_processor: the model's transformers image processor (a vision-language model, see
            :mod:`.images`): image parts are accepted within ``image_limits``; without one they
            are a 400.

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
                 turn_end_ids: Sequence[int] | None = None, access_log_path: str | None = None,
                 lora_path: str | None = None, return_routed_experts: bool = False,
                 on_engine_lost: Callable[[str], None] | None = None, engine_retries: int = 0,
                 engine_wait_s: float = 300.0, image_processor: Any = None,
                 image_limits: ImageLimits | None = None) -> None:
        self.tokenizer = _load_tokenizer(tokenizer)
        self.renderer = ChatRenderer(self.tokenizer, chat_template=chat_template, turn_end_ids=turn_end_ids)
        self.balancer = EngineBalancer(engine_urls)
        self.known_engines: set[str] = set(self.balancer.urls)  # what /admin/engines may switch to
        for i, mw in enumerate(middlewares):
            if not isinstance(mw, RouterMiddleware):
                raise TypeError(f"middleware #{i} ({type(mw).__name__}) lacks on_request/on_response")
        self.model_name = model_name
        self.secret = secret
        for name, value in (("max_request_bytes", max_request_bytes), ("max_prompt_chars", max_prompt_chars),
                            ("render_threads", render_threads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AgentFlowRouter: {name} must be a positive integer, got {value!r}")
        self.max_request_bytes = max_request_bytes
        self.access_log = AccessLog(access_log_path)
        self._render_pool = concurrent.futures.ThreadPoolExecutor(max_workers=render_threads,
                                                                  thread_name_prefix="agentflow-render")
        self.registry = TrajectoryRegistry(self.renderer, self._abort_at_engine, self.balancer.forget, secret=secret,
                                           default_sampling=default_sampling, max_context_length=max_context_length)
        self.engines = EnginePool(secret, engine_timeout_s, lora_path, return_routed_experts)
        limits = TurnLimits(max_prompt_chars=max_prompt_chars, max_continuations=max_continuations,
                            engine_retries=engine_retries, engine_wait_s=engine_wait_s)
        images = None if image_processor is None else ImageInputs(image_processor, self.tokenizer, image_limits)
        self.turns = TurnRunner(self.registry, self.renderer, self.balancer, self.engines, middlewares, model_name,
                                limits, self._render_pool, on_engine_lost, images)
        self.server = ThreadedServer(self._build_app(), host=host, port=port, name="agentflow-router",
                                     handler_cancellation=True)  # a client that goes away cancels its turn
        self.blocking = BlockingView(self, self.server.call)
        """Synchronous trajectory API: ``router.blocking.register(...)`` runs ``await router.aregister(...)``."""

    def _build_app(self) -> Any:
        app = build_app(self)

        async def close_engine_clients(_app: Any) -> None:
            await self.engines.aclose()

        app.on_cleanup.append(close_engine_clients)
        return app

    def _abort_at_engine(self, url: str, rid: str) -> None:
        self.turns.abort_at_engine(url, rid)

    # ------------------------------------------------------------------------ life cycle
    @property
    def host(self) -> str:
        return self.server.host

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def base_url(self) -> str | None:
        return self.server.base_url

    @property
    def app(self) -> Any:
        """The aiohttp application (its routes, for tests and tools)."""
        return self.server.app

    def start(self, timeout_s: float = 30.0) -> str:
        """Start serving in a background thread; returns the base URL ``http://HOST:PORT``."""
        if self.server.running:
            return str(self.server.base_url)
        return self.server.start(timeout_s)

    def shutdown(self) -> None:
        """Stop serving and join the server thread (idempotent)."""
        if not self.server.running:
            return
        self.server.stop()
        self._render_pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "AgentFlowRouter":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

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
        return self.registry.key(trajectory_id, attempt)

    async def aregister(self, trajectory_id: str, *, attempt: int = 0,
                        sampling: Mapping[str, Any] | SamplingParams | None = None,
                        max_response_tokens: int | None = None, max_context_length: int | None = None,
                        metadata: Mapping[str, Any] | None = None, priority: int | None = None) -> str:
        """Register a trajectory and return its OpenAI base URL.

        ``sampling`` holds defaults in SGLang names (``temperature``, ``top_p``, ``top_k``,
        ``max_new_tokens``, ``seed``, ``stop_token_ids``; ``locked=True`` makes them override the
        request). ``max_response_tokens`` caps the generated tokens over all turns,
        ``max_context_length`` the tokens of a segment; a turn that hits either ends with
        ``finish_reason="length"``. Registering an id again (a retry, usually with
        ``attempt + 1``) aborts and replaces the old record; requests to the old attempt get 404.
        ``priority`` goes with every engine call of the trajectory (SGLang's ``priority``: larger is
        admitted sooner; an asynchronous run gives a group's by its deadline).
        """
        def register() -> str:
            self.registry.register(trajectory_id, attempt, sampling, max_response_tokens, max_context_length,
                                   metadata, priority)
            return self.url_for(trajectory_id, attempt)

        return await self.server.on_loop(register)

    async def aget(self, trajectory_id: str) -> TrajectoryRecord:
        """A copy of the trajectory's record as it stands (KeyError if unknown)."""
        return await self.server.on_loop(lambda: self.registry.snapshot(trajectory_id))

    async def apop(self, trajectory_id: str) -> TrajectoryRecord:
        """Remove the trajectory and return its record; later requests to it get 404.

        A request still in flight is aborted at the engine and never recorded.
        """
        return await self.server.on_loop(lambda: self.registry.pop(trajectory_id))

    async def aabort(self, trajectory_id: str) -> None:
        """Mark the trajectory aborted, abort its in-flight generation; later calls get 409."""
        await self.server.on_loop(lambda: self.registry.abort(trajectory_id))

    async def aset_engines(self, urls: Sequence[str]) -> None:
        """Replace the engine list (e.g. after engines restarted). Only this Python API may add
        engines the router has not seen; ``POST /admin/engines`` chooses among known ones."""
        def set_engines() -> None:
            self.balancer.set_engines(urls)
            self.known_engines.update(self.balancer.urls)

        await self.server.on_loop(set_engines)

    async def astats(self) -> dict[str, Any]:
        """Counters: requests, errors, engine calls, generated tokens, live trajectories, load."""
        return await self.server.on_loop(self.stats_now)

    def stats_now(self) -> dict[str, Any]:
        """:meth:`astats` on the router's loop."""
        return {**self.turns.stats, "trajectories": len(self.registry), "in_flight": dict(self.balancer.in_flight)}
