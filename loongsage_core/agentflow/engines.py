"""Talking to rollout engines: SGLang's native ``/generate`` and spreading load over engines.

The router sends token ids, never text: ``POST /generate`` with ``input_ids``,
``sampling_params``, ``return_logprob`` and a request id, and reads ``output_ids``, the per-token
log-probs, the finish reason and the weight versions. The HTTP calls and the reading of answers
are the host's engine client (:class:`~loongsage_core.engine_client.EngineClient`, also used by
the controller's fast path); :class:`EnginePool` holds one client per engine and turns the
client's failures into the router's answers (:class:`~.errors.RouterError`: 400 when the engine
rejected the request, 502 for a bad answer, 503 when it cannot be reached).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence

import attrs
import httpx

from loongsage_hookspecs import RoutedExperts

from ..engine_client import EngineClient
from ..engine_results import EngineError, EngineProtocolError, GenerationResult, speculation_counts
from .errors import RouterError

ABORT_TIMEOUT_S = 5.0
INFO_TIMEOUT_S = 10.0


@attrs.define
class EngineOutput:
    """One generation as the router records it: tokens, their log-probs and policy versions."""

    output_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str  # "" while a stream is still generating
    matched_stop: Any = None
    top_logprobs: list[list[tuple[float, int]]] | None = None
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache (SGLang's meta_info)
    routed_experts: RoutedExperts | None = None  # the experts of every position the engine ran, when asked
    speculative: dict[str, int] | None = None  # a speculative-decoding engine's counters (speculation_counts)


def engine_output(res: GenerationResult, url: str) -> EngineOutput:
    """The router's view of a generation: one log-prob per token (502 otherwise), integer versions."""
    try:
        logprobs, versions = res.token_record()
    except ValueError as exc:
        raise RouterError(502, f"engine {url}: {exc}", type="api_error", code="engine_error") from None
    return EngineOutput(res.output_ids, logprobs, versions, res.finish_reason, res.finish_detail.get("matched"),
                        res.top_logprobs, cached_tokens=res.cached_tokens, routed_experts=res.routed_experts,
                        speculative=speculation_counts(res.meta_info))


def parse_generate_response(data: Any, url: str) -> EngineOutput:
    """Read one ``/generate`` result (a batch of one too); a malformed answer is a 502 naming the engine."""
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    try:
        res = GenerationResult.from_response(data)
    except EngineError as exc:
        raise as_router_error(exc, url) from None
    out = engine_output(res, url)
    out.finish_reason = out.finish_reason or "stop"
    return out


def as_router_error(exc: Exception, url: str) -> RouterError:
    """The router's answer for a failed engine call."""
    if isinstance(exc, EngineProtocolError):
        return RouterError(502, f"engine {url} {exc.message}", type="api_error", code="engine_error")
    if isinstance(exc, EngineError):
        if 400 <= exc.status_code < 500 and exc.status_code not in (404, 408, 429):
            return RouterError(400, f"the rollout engine rejected the request: {exc.message}",
                               code="engine_rejected", retry=False)
        # a 5xx may be a load balancer whose engine died: the engine may be gone (engine_url set)
        return RouterError(502, f"engine {url} answered HTTP {exc.status_code}: {exc.message[:500]}",
                           type="api_error", code="engine_error",
                           engine_url=url if exc.status_code >= 500 else None)
    return RouterError(503, f"engine {url} unreachable: {type(exc).__name__}: {exc}", type="api_error",
                       code="engine_unavailable", engine_url=url)


class EngineBalancer:
    """Chooses an engine per request: sticky per trajectory, else the least-loaded one.

    A trajectory keeps its engine across turns so the engine's prefix cache holds its history;
    a new trajectory goes to the engine with the fewest requests in flight (ties: the fewest
    trajectories assigned, then list order). An engine that could not be reached is marked
    *down* (:meth:`mark_down`): no request goes there while another engine is up, until the
    engine list is set again (:meth:`set_engines`, e.g. after the host replaced a dead engine).
    """

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls: list[str] = []
        self.in_flight: dict[str, int] = {}
        self.sticky: dict[str, str] = {}
        self.down: set[str] = set()
        self._changed: asyncio.Event | None = None  # made on the router's loop, set when the list changes
        self.set_engines(urls)

    def set_engines(self, urls: Sequence[str]) -> None:
        """Replace the engine list; trajectories on a removed engine move on their next request.
        Every engine of the new list counts as up."""
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise ValueError("AgentFlow router needs at least one engine URL")
        self.urls = list(dict.fromkeys(urls))
        self.in_flight = {u: self.in_flight.get(u, 0) for u in self.urls}
        self.sticky = {t: u for t, u in self.sticky.items() if u in self.in_flight}
        self.down.clear()
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def mark_down(self, url: str) -> None:
        """``url`` could not be reached: send nothing there while another engine is up."""
        if url in self.in_flight:
            self.down.add(url)
            self.sticky = {t: u for t, u in self.sticky.items() if u != url}

    def usable(self) -> list[str]:
        """The engines requests may go to: those up, or every engine when all are down."""
        return [u for u in self.urls if u not in self.down] or list(self.urls)

    async def wait_until_up(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until some engine is up; ``False`` when none came up."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while all(u in self.down for u in self.urls):
            left = deadline - loop.time()
            if left <= 0:
                return False
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    def pick(self, trajectory_id: str) -> str:
        url = self.sticky.get(trajectory_id)
        if url is None:
            urls = self.usable()
            assigned: dict[str, int] = {u: 0 for u in self.urls}
            for u in self.sticky.values():
                assigned[u] += 1
            url = min(urls, key=lambda u: (self.in_flight[u], assigned[u], self.urls.index(u)))
            self.sticky[trajectory_id] = url
        return url

    def forget(self, trajectory_id: str) -> None:
        self.sticky.pop(trajectory_id, None)

    def acquire(self, url: str) -> None:
        if url in self.in_flight:
            self.in_flight[url] += 1

    def release(self, url: str) -> None:
        if url in self.in_flight and self.in_flight[url] > 0:
            self.in_flight[url] -= 1


class EnginePool:
    """One :class:`EngineClient` per engine URL (made on first use, on the router's event loop).

    Args:
        secret: the run secret every request carries.
        timeout_s: the limit of one ``/generate`` call.
        lora_path: the LoRA adapter every generation names (a LoRA run's), or ``None``.
        return_routed_experts: every generation asks for the experts each token was routed to
            (a mixture-of-experts policy trained with ``[algorithm] router_replay``).
    """

    def __init__(self, secret: str | None, timeout_s: float | None, lora_path: str | None = None,
                 return_routed_experts: bool = False) -> None:
        self.secret = secret
        self.timeout_s = timeout_s
        self.lora_path = lora_path
        self.return_routed_experts = return_routed_experts
        self._clients: dict[str, EngineClient] = {}

    def client(self, url: str) -> EngineClient:
        if url not in self._clients:  # no connection limit: the balancer spreads the load
            self._clients[url] = EngineClient(url, timeout=self.timeout_s, api_key=self.secret, max_connections=None,
                                              lora_path=self.lora_path,
                                              return_routed_experts=self.return_routed_experts)
        return self._clients[url]

    async def generate(self, url: str, input_ids: list[int], sampling_params: dict[str, Any], rid: str,
                       top_logprobs_num: int = 0, image_data: list[str] | None = None,
                       priority: int | None = None) -> EngineOutput:
        """One generation (errors become 400/502/503 :class:`RouterError`); ``image_data``: the
        prompt's images in token order (base64); ``priority``: SGLang's (larger runs sooner)."""
        try:
            (res,) = await self.client(url).generate(input_ids, sampling_params, rids=[rid],
                                                     top_logprobs_num=top_logprobs_num, image_data=image_data,
                                                     priority=priority)
        except (EngineError, httpx.HTTPError, OSError) as exc:
            raise as_router_error(exc, url) from exc
        out = engine_output(res, url)
        out.finish_reason = out.finish_reason or "stop"
        return out

    async def generate_stream(self, url: str, input_ids: list[int], sampling_params: dict[str, Any], rid: str,
                              top_logprobs_num: int = 0, image_data: list[str] | None = None,
                              priority: int | None = None) -> AsyncIterator[EngineOutput]:
        """One streamed generation: the whole generation so far after every chunk; the last item
        has the finish reason. Leaving early closes the connection (the engine aborts the request)."""
        stream = self.client(url).generate_stream(input_ids, sampling_params, rid=rid,
                                                  top_logprobs_num=top_logprobs_num, image_data=image_data,
                                                  priority=priority)
        try:
            async for res in stream:
                yield engine_output(res, url)
        except (EngineError, httpx.HTTPError, OSError) as exc:
            raise as_router_error(exc, url) from exc
        finally:
            await stream.aclose()

    async def abort(self, url: str, rid: str) -> None:
        """Ask ``url`` to abort request ``rid`` (best effort: errors are ignored)."""
        try:
            await self.client(url).abort(rid, timeout=ABORT_TIMEOUT_S)
        except (EngineError, httpx.HTTPError, OSError):
            pass

    async def context_length(self, url: str) -> tuple[bool, int | None]:
        """``(reachable, context length)`` of the engine at ``url``: ``/get_model_info``, else
        ``/get_server_info``; the length is ``None`` when neither names one."""
        client = self.client(url)
        for ask, keys in ((client.model_info, ("max_context_length", "context_length")),
                          (client.server_info, ("context_length", "max_context_length"))):
            try:
                info = await ask(timeout=INFO_TIMEOUT_S)
            except EngineError:
                info = {}
            except (httpx.HTTPError, OSError, ValueError):
                return False, None
            values = [info.get(k) for k in keys if isinstance(info, dict)]
            found = next((int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)
            if found is not None:
                return True, found
        return True, None

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
