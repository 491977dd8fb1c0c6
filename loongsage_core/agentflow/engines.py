"""Talking to rollout engines: SGLang's native ``/generate`` and spreading load over engines.

The router sends token ids, never text: ``POST /generate`` with ``input_ids``,
``sampling_params``, ``return_logprob`` and a request id, and reads ``output_ids``, the per-token
log-probs (``meta_info.output_token_logprobs``), the finish reason and the weight version.
:func:`engine_generate_stream` asks for ``stream: true`` and yields the generation as it grows
(SGLang's server-sent events: ``data: {...}`` lines, ``data: [DONE]`` at the end).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Sequence

import attrs

from loongsage_hookspecs import parse_weight_version

from .errors import RouterError


@attrs.define
class EngineOutput:
    """One generation: the sampled tokens, their log-probs and policy versions."""

    output_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str
    matched_stop: Any = None
    top_logprobs: list[list[tuple[float, int]]] | None = None
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache (SGLang's meta_info)


def _version(value: Any) -> int:
    """A weight version as an int (engines may send it as a string); -1 when unknown."""
    version = parse_weight_version(value)
    return -1 if version is None else version


def _token_versions(meta: dict[str, Any], n: int) -> list[int]:
    """Per-token weight versions: ``output_token_weight_versions`` (one per token), else the
    ``weight_versions`` spans ``[{"version", "start", "end"}]``, else ``weight_version`` for all."""
    per_token = meta.get("output_token_weight_versions")
    if isinstance(per_token, list) and len(per_token) == n:
        return [_version(v) for v in per_token]
    spans = meta.get("weight_versions")
    if isinstance(spans, list) and spans and all(isinstance(s, dict) for s in spans):
        out = [_version(meta.get("weight_version"))] * n
        for span in spans:
            start, end = int(span.get("start", 0)), int(span.get("end", n))
            out[max(0, start):min(n, end)] = [_version(span.get("version"))] * max(0, min(n, end) - max(0, start))
        return out
    return [_version(meta.get("weight_version"))] * n


def parse_generate_response(data: Any, url: str) -> EngineOutput:
    """Read one SGLang ``/generate`` result; a malformed answer is a 502 naming the engine."""
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise RouterError(502, f"engine {url} returned an unexpected /generate body", type="api_error",
                          code="engine_error")
    meta = data["meta_info"]
    out_ids = data.get("output_ids")
    if out_ids is None:
        raise RouterError(502, f"engine {url} did not return output_ids", type="api_error", code="engine_error")
    out_ids = [int(t) for t in out_ids]
    token_lps = meta.get("output_token_logprobs") or []
    if len(token_lps) != len(out_ids):
        raise RouterError(502, f"engine {url} returned {len(token_lps)} log-probs for {len(out_ids)} tokens",
                          type="api_error", code="engine_error")
    logprobs = [float(e[0]) if e[0] is not None else 0.0 for e in token_lps]
    versions = _token_versions(meta, len(out_ids))
    fr = meta.get("finish_reason")
    if isinstance(fr, dict):
        kind, matched = str(fr.get("type")), fr.get("matched")
    else:
        kind, matched = str(fr) if fr is not None else "stop", None
    top = meta.get("output_top_logprobs")
    top_lps = None
    if isinstance(top, list) and len(top) == len(out_ids):
        top_lps = [[(float(e[0]), int(e[1])) for e in (row or []) if e and e[0] is not None] for row in top]
    cached = meta.get("cached_tokens")
    return EngineOutput(out_ids, logprobs, versions, kind, matched, top_lps,
                        cached_tokens=int(cached) if isinstance(cached, int) else 0)


class EngineBalancer:
    """Chooses an engine per request: sticky per trajectory, else the least-loaded one.

    A trajectory keeps its engine across turns so the engine's prefix cache holds its history;
    a new trajectory goes to the engine with the fewest requests in flight (ties: the fewest
    trajectories assigned, then list order).
    """

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls: list[str] = []
        self.in_flight: dict[str, int] = {}
        self.sticky: dict[str, str] = {}
        self.set_engines(urls)

    def set_engines(self, urls: Sequence[str]) -> None:
        """Replace the engine list; trajectories on a removed engine move on their next request."""
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise ValueError("AgentFlow router needs at least one engine URL")
        self.urls = list(dict.fromkeys(urls))
        self.in_flight = {u: self.in_flight.get(u, 0) for u in self.urls}
        self.sticky = {t: u for t, u in self.sticky.items() if u in self.in_flight}

    def pick(self, trajectory_id: str) -> str:
        url = self.sticky.get(trajectory_id)
        if url is None:
            assigned: dict[str, int] = {u: 0 for u in self.urls}
            for u in self.sticky.values():
                assigned[u] += 1
            url = min(self.urls, key=lambda u: (self.in_flight[u], assigned[u], self.urls.index(u)))
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


async def engine_generate(session: Any, url: str, payload: dict[str, Any], timeout_s: float | None) -> EngineOutput:
    """POST ``payload`` to ``url``/generate and parse the answer (errors become 502/503)."""
    import aiohttp

    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(f"{url}/generate", json=payload, timeout=timeout) as resp:
            text = await resp.text()
            if 400 <= resp.status < 500 and resp.status not in (404, 408, 429):
                try:
                    detail = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    detail = text[:500]
                raise RouterError(400, f"the rollout engine rejected the request: {detail}", code="engine_rejected",
                                  retry=False)
            if resp.status != 200:
                raise RouterError(502, f"engine {url} answered HTTP {resp.status}: {text[:500]}", type="api_error",
                                  code="engine_error")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise RouterError(503, f"engine {url} unreachable: {type(exc).__name__}: {exc}", type="api_error",
                          code="engine_unavailable") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RouterError(502, f"engine {url} returned invalid JSON", type="api_error", code="engine_error") from exc
    return parse_generate_response(data, url)


def _merge_chunk(prev: EngineOutput | None, data: Any, url: str) -> EngineOutput:
    """Fold one streamed ``/generate`` chunk into the generation so far.

    SGLang streams cumulative ``output_ids`` and log-probs by default and increments with
    ``--incremental-streaming-output``; ``meta_info.completion_tokens`` (the total so far) tells
    which, so both work.
    """
    if isinstance(data, dict) and isinstance(data.get("meta_info"), dict):
        meta = data["meta_info"]
        total = meta.get("completion_tokens")
        ids = data.get("output_ids")
        lps = meta.get("output_token_logprobs")
        if prev is not None and isinstance(ids, list) and isinstance(total, int) and total > len(ids) \
                and total == len(prev.output_ids) + len(ids):  # an increment: make it cumulative
            data = {**data, "output_ids": prev.output_ids + ids,
                    "meta_info": {**meta, "output_token_logprobs": [[lp, t] for lp, t in
                                                                    zip(prev.logprobs, prev.output_ids)]
                                  + list(lps or [])}}
            if prev.top_logprobs is not None and isinstance(meta.get("output_top_logprobs"), list):
                data["meta_info"]["output_top_logprobs"] = (
                    [[[lp, t] for lp, t in row] for row in prev.top_logprobs] + meta["output_top_logprobs"])
    out = parse_generate_response(data, url)
    if isinstance(data, dict) and data["meta_info"].get("finish_reason") is None:
        out.finish_reason = ""  # still generating
    return out


async def engine_generate_stream(session: Any, url: str, payload: dict[str, Any],
                                 timeout_s: float | None) -> AsyncIterator[EngineOutput]:
    """POST ``payload`` with ``stream: true``; yield the whole generation so far after every chunk.

    The last item has the finish reason; earlier ones have ``finish_reason == ""``. Leaving the
    iteration early closes the connection, which aborts the request at the engine.
    """
    import aiohttp

    out: EngineOutput | None = None
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(f"{url}/generate", json={**payload, "stream": True}, timeout=timeout) as resp:
            if resp.status != 200:
                text = await resp.text()
                if 400 <= resp.status < 500 and resp.status not in (404, 408, 429):
                    try:
                        detail = json.loads(text)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        detail = text[:500]
                    raise RouterError(400, f"the rollout engine rejected the request: {detail}",
                                      code="engine_rejected", retry=False)
                raise RouterError(502, f"engine {url} answered HTTP {resp.status}: {text[:500]}", type="api_error",
                                  code="engine_error")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                body = line[5:].strip()
                if body == b"[DONE]":
                    break
                try:
                    data = json.loads(body)
                except ValueError as exc:
                    raise RouterError(502, f"engine {url} streamed invalid JSON", type="api_error",
                                      code="engine_error") from exc
                if isinstance(data, dict) and "error" in data and "meta_info" not in data:
                    raise RouterError(502, f"engine {url} failed mid-stream: {data['error']}", type="api_error",
                                      code="engine_error")
                out = _merge_chunk(out, data, url)
                yield out
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise RouterError(503, f"engine {url} unreachable: {type(exc).__name__}: {exc}", type="api_error",
                          code="engine_unavailable") from exc
    if out is None or not out.finish_reason:
        raise RouterError(502, f"engine {url} ended the stream before the generation finished", type="api_error",
                          code="engine_error")


async def engine_abort(session: Any, url: str, rid: str) -> None:
    """Ask ``url`` to abort request ``rid`` (best effort: errors are ignored)."""
    import aiohttp

    try:
        async with session.post(f"{url}/abort_request", json={"rid": rid},
                                timeout=aiohttp.ClientTimeout(total=5)) as resp:
            await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        pass
