"""Client of a rollout engine's SGLang-native HTTP API (the embedded engine or a real SGLang server).

The same field names go over the wire to both engines: ``/generate`` with ``input_ids`` (always
sent as a batch), ``sampling_params``, ``return_logprob`` and ``rid``; ``/abort_request``;
``/pause_generation``; ``/continue_generation``; ``/flush_cache``; ``/get_weight_version``;
``/update_weights_from_tensor``; ``/release_memory_occupation`` / ``/resume_memory_occupation``;
``/health``. Responses are read defensively: per-token weight
versions come from the LoongSage field ``meta_info.output_token_weight_versions`` when present,
else from SGLang's ``meta_info.weight_versions`` spans, else from ``meta_info.weight_version``
repeated. Weight versions that are decimal strings (SGLang's type) become ints.

Every method exists twice: ``await client.generate(...)`` (httpx.AsyncClient) and
``client.generate_sync(...)`` (httpx.Client). A 4xx/5xx answer raises :class:`EngineError` with
the engine's own message.

Every request carries the run secret (``Authorization: Bearer``) when the client has one: the
``api_key`` argument, else the secret set in this process (:mod:`loongsage_core.security`).

Importing this module does not import torch; :func:`encode_direct_tensors` imports it when called.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncGenerator, Iterable, Mapping, Sequence, cast

import attrs
import httpx

from loongsage_hookspecs import parse_weight_version

from .security import engine_headers

if TYPE_CHECKING:  # pragma: no cover
    import torch


class EngineError(RuntimeError):
    """The engine answered with an error status; ``message`` is the engine's own explanation."""

    def __init__(self, status_code: int, message: str, path: str, param: str | None = None) -> None:
        super().__init__(f"engine {path} failed with HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.path = path
        self.param = param


class EngineProtocolError(EngineError):
    """The engine answered, but not in SGLang's format (a malformed ``/generate`` body or stream)."""

    def __init__(self, message: str, path: str = "/generate") -> None:
        super().__init__(502, message, path)


def _version(value: Any) -> int | str | None:
    """A weight version as an int when it is one (SGLang sends strings), else unchanged."""
    version = parse_weight_version(value)
    return value if version is None else version


@attrs.define
class GenerationResult:
    """One generated sequence.

    ``logprobs[i]`` is the engine's log-probability of ``output_ids[i]`` (``None`` entries when the
    engine gave none); ``weight_versions[i]`` the weight version that produced it;
    ``finish_reason`` is ``"stop"``, ``"length"`` or ``"abort"`` (details in ``finish_detail``).
    """

    rid: str
    output_ids: list[int]
    logprobs: list[float | None] | None
    finish_reason: str
    finish_detail: dict[str, Any]
    weight_version: int | str | None
    weight_versions: list[int | str | None]
    prompt_tokens: int
    cached_tokens: int
    text: str
    meta_info: dict[str, Any] = attrs.field(repr=False)
    top_logprobs: list[list[tuple[float, int]]] | None = None  # per token: (log-prob, token id) of the most likely

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    def token_record(self) -> tuple[list[float], list[int]]:
        """Log-probs and weight versions of ``output_ids`` as a :class:`~loongsage_hookspecs.Segment`
        records them, by the AgentFlow router's rule: one log-prob per token (an entry the engine
        left empty counts 0.0) and integer versions (-1 where unknown). An answer without one
        log-prob per token is a ``ValueError`` naming the request."""
        n = len(self.output_ids)
        if self.logprobs is None or len(self.logprobs) != n:
            got = "no" if self.logprobs is None else str(len(self.logprobs))
            raise ValueError(f"request {self.rid!r}: the engine returned {got} log-probs for {n} tokens")
        logprobs = [0.0 if lp is None else float(lp) for lp in self.logprobs]
        versions = [v if isinstance(v, int) and not isinstance(v, bool) else -1 for v in self.weight_versions]
        return logprobs, versions

    @classmethod
    def from_response(cls, obj: Any, rid: str | None = None) -> "GenerationResult":
        """Read one element of a ``/generate`` response (SGLang's format; the one reader of it).

        Per-token weight versions: ``meta_info.output_token_weight_versions`` (one per token),
        else the ``weight_versions`` spans ``[{"version", "start", "end"}]`` over
        ``weight_version``, else ``weight_version`` for every token. An answer without
        ``meta_info`` or ``output_ids`` is an :class:`EngineProtocolError`.
        """
        if not isinstance(obj, Mapping) or not isinstance(obj.get("meta_info"), Mapping):
            raise EngineProtocolError("returned an unexpected /generate body")
        if not isinstance(obj.get("output_ids"), list):
            raise EngineProtocolError("did not return output_ids")
        meta = dict(obj["meta_info"])
        output_ids = [int(t) for t in obj["output_ids"]]
        n = len(output_ids)
        finish = meta.get("finish_reason")
        if isinstance(finish, Mapping):
            detail = dict(finish)
            kind = str(finish.get("type") or "")
        else:  # no finish reason: the request is still streaming or the engine omitted it
            detail, kind = {}, str(finish or "")
        lp_triples = meta.get("output_token_logprobs")
        logprobs = None
        if lp_triples is not None:
            logprobs = [None if e is None or e[0] is None else float(e[0]) for e in lp_triples]
        top = meta.get("output_top_logprobs")
        top_logprobs = None
        if isinstance(top, list) and len(top) == n:
            top_logprobs = [[(float(e[0]), int(e[1])) for e in (row or []) if e and e[0] is not None] for row in top]
        version = _version(meta.get("weight_version"))
        versions: list[int | str | None] = [version] * n
        per_token, spans = meta.get("output_token_weight_versions"), meta.get("weight_versions")
        if isinstance(per_token, list) and len(per_token) == n:
            versions = [_version(v) for v in per_token]
        elif isinstance(spans, list) and spans and all(isinstance(span, Mapping) for span in spans):
            for span in spans:
                start, end = max(0, int(span.get("start", 0))), min(n, int(span.get("end", n)))
                versions[start:end] = [_version(span.get("version"))] * max(0, end - start)
        cached = meta.get("cached_tokens")
        return cls(rid=str(meta.get("id") or rid or ""), output_ids=output_ids, logprobs=logprobs,
                   finish_reason=kind, finish_detail=detail, weight_version=version, weight_versions=versions,
                   prompt_tokens=int(meta.get("prompt_tokens") or 0),
                   cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool) else 0,
                   text=str(obj.get("text") or ""), meta_info=meta, top_logprobs=top_logprobs)


def merge_stream_chunk(prev: GenerationResult | None, data: Any) -> GenerationResult:
    """Fold one streamed ``/generate`` chunk into the generation so far (``prev``).

    SGLang streams cumulative ``output_ids`` and log-probs by default and increments with
    ``--incremental-streaming-output``; ``meta_info.completion_tokens`` (the total so far) tells
    which, so both work. ``finish_reason`` is ``""`` until the last chunk.
    """
    if prev is not None and isinstance(data, Mapping) and isinstance(data.get("meta_info"), Mapping):
        meta = data["meta_info"]
        total, ids = meta.get("completion_tokens"), data.get("output_ids")
        if isinstance(ids, list) and isinstance(total, int) and total > len(ids) \
                and total == len(prev.output_ids) + len(ids):  # an increment: make it cumulative
            earlier = [[lp, t] for lp, t in zip(prev.logprobs or [], prev.output_ids)]
            merged = {**meta, "output_token_logprobs": earlier + list(meta.get("output_token_logprobs") or [])}
            if prev.top_logprobs is not None and isinstance(meta.get("output_top_logprobs"), list):
                merged["output_top_logprobs"] = ([[[lp, t] for lp, t in row] for row in prev.top_logprobs]
                                                 + meta["output_top_logprobs"])
            data = {**data, "output_ids": prev.output_ids + ids, "meta_info": merged}
    return GenerationResult.from_response(data)


def encode_direct_tensors(named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> str:
    """``serialized_named_tensors`` for ``load_format="direct"`` of the embedded engine:
    base64 of ``torch.save`` of the ``(name, tensor)`` list (tensors moved to CPU)."""
    import torch

    buf = io.BytesIO()
    torch.save([(name, t.detach().cpu().contiguous()) for name, t in named_tensors], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _check(resp: httpx.Response, path: str) -> httpx.Response:
    if resp.status_code < 400:
        return resp
    message, param = resp.text.strip(), None
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping):
            message = str(err.get("message") or message)
            param = err.get("param")
        elif isinstance(err, str):
            message = err
        elif body.get("message"):
            message = str(body["message"])
    raise EngineError(resp.status_code, message or resp.reason_phrase, path, param)


def _json_or_text(resp: httpx.Response) -> Any:
    if not resp.content:
        return {}
    try:
        return resp.json()
    except ValueError:
        return {"message": resp.text}


class EngineClient:
    """Talks to one engine at ``base_url`` (``http://host:port``)."""

    def __init__(self, base_url: str, *, timeout: float | None = 600.0, api_key: str | None = None,
                 max_connections: int | None = 100, lora_path: str | None = None) -> None:
        """``lora_path``: the LoRA adapter every ``/generate`` names (SGLang's per-request adapter;
        a LoRA run's :data:`~loongsage_hookspecs.LORA_ADAPTER_NAME`), ``None`` for the base model."""
        self.base_url = base_url.rstrip("/")
        self.lora_path = lora_path
        self.timeout = timeout
        self.headers = engine_headers(api_key)
        # without a connection limit every connection is kept alive for reuse (the router's case)
        self.limits = httpx.Limits(max_connections=max_connections,
                                   max_keepalive_connections=None if max_connections is None else 20)
        self._async: httpx.AsyncClient | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None
        self._sync: httpx.Client | None = None

    # ------------------------------------------------------------------------------------------
    # plumbing
    # ------------------------------------------------------------------------------------------
    def _aclient(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._async is None or self._async_loop is not loop or self._async.is_closed:
            self._async = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, headers=self.headers,
                                            limits=self.limits)
            self._async_loop = loop
        return self._async

    def _sclient(self) -> httpx.Client:
        if self._sync is None or self._sync.is_closed:
            self._sync = httpx.Client(base_url=self.base_url, timeout=self.timeout, headers=self.headers)
        return self._sync

    async def _request(self, method: str, path: str, json: Any = None, timeout: float | None | str = "default") -> Any:
        kw: dict[str, Any] = {} if timeout == "default" else {"timeout": timeout}
        resp = await self._aclient().request(method, path, json=json, **kw)
        return _json_or_text(_check(resp, path))

    def _request_sync(self, method: str, path: str, json: Any = None, timeout: float | None | str = "default") -> Any:
        kw: dict[str, Any] = {} if timeout == "default" else {"timeout": timeout}
        resp = self._sclient().request(method, path, json=json, **kw)
        return _json_or_text(_check(resp, path))

    async def aclose(self) -> None:
        if self._async is not None:
            await self._async.aclose()
            self._async = None
        self.close()

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    # ------------------------------------------------------------------------------------------
    # request building
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def generate_payload(input_ids: Sequence[Sequence[int]] | Sequence[int],
                         sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                         *, return_logprob: bool = True, rids: Sequence[str] | None = None,
                         top_logprobs_num: int = 0) -> dict[str, Any]:
        """The ``/generate`` body for a batch (a single prompt is sent as a batch of one);
        ``top_logprobs_num`` asks for that many most likely tokens per position."""
        extra = {"top_logprobs_num": top_logprobs_num} if top_logprobs_num else {}
        rows: Any = input_ids
        batch = [[int(t) for t in p] for p in rows] if rows and isinstance(rows[0], (list, tuple)) \
            else [[int(t) for t in rows]]
        if rids is None:
            rids = [uuid.uuid4().hex for _ in batch]
        elif len(rids) != len(batch):
            raise ValueError(f"rids has {len(rids)} entries for a batch of {len(batch)} prompts")
        params: Any
        if isinstance(sampling_params, (list, tuple)):
            params = [dict(p) for p in sampling_params]
        else:
            params = dict(cast(Mapping[str, Any], sampling_params or {}))
        if len(batch) == 1:
            # a batch of one goes unbatched: SGLang routers accept only a string rid
            single = params[0] if isinstance(params, list) else params
            return {"input_ids": batch[0], "sampling_params": single, "return_logprob": return_logprob,
                    "rid": rids[0], **extra}
        return {"input_ids": batch, "sampling_params": params, "return_logprob": return_logprob,
                "rid": list(rids), **extra}

    def _with_adapter(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` naming this client's LoRA adapter (``lora_path``), when it has one."""
        if self.lora_path is not None:
            payload["lora_path"] = self.lora_path
        return payload

    @staticmethod
    def _rid_list(payload: Mapping[str, Any]) -> list[str]:
        rid = payload["rid"]
        return list(rid) if isinstance(rid, list) else [rid]

    @staticmethod
    def _results(body: Any, rids: Sequence[str]) -> list[GenerationResult]:
        items = body if isinstance(body, list) else [body]
        return [GenerationResult.from_response(obj, rid) for obj, rid in zip(items, rids)]

    # ------------------------------------------------------------------------------------------
    # async API
    # ------------------------------------------------------------------------------------------
    async def generate(self, input_ids: Sequence[Sequence[int]] | Sequence[int],
                       sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                       *, return_logprob: bool = True, rids: Sequence[str] | None = None,
                       top_logprobs_num: int = 0) -> list[GenerationResult]:
        """Generate for every prompt of ``input_ids``; results in prompt order."""
        payload = self._with_adapter(self.generate_payload(input_ids, sampling_params, return_logprob=return_logprob,
                                                           rids=rids, top_logprobs_num=top_logprobs_num))
        body = await self._request("POST", "/generate", payload)
        return self._results(body, self._rid_list(payload))

    async def generate_stream(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any] | None = None,
                              *, rid: str, return_logprob: bool = True,
                              top_logprobs_num: int = 0) -> AsyncGenerator[GenerationResult, None]:
        """Generate for one prompt with ``stream: true``; yields the whole generation so far after
        every chunk (SGLang's server-sent events), the last one with its finish reason.

        Leaving the iteration early closes the connection, which aborts the request at the engine.
        A stream that breaks off or carries an error is an :class:`EngineProtocolError`.
        """
        payload = {**self._with_adapter(self.generate_payload(input_ids, sampling_params, return_logprob=return_logprob,
                                                              rids=[rid], top_logprobs_num=top_logprobs_num)),
                   "stream": True}
        out: GenerationResult | None = None
        async with self._aclient().stream("POST", "/generate", json=payload) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _check(resp, "/generate")
            async for raw in resp.aiter_lines():
                line = raw.strip()
                if not line.startswith("data:"):
                    continue
                body = line[5:].strip()
                if body == "[DONE]":
                    break
                try:
                    data = json.loads(body)
                except ValueError:
                    raise EngineProtocolError("streamed invalid JSON") from None
                if isinstance(data, Mapping) and "error" in data and "meta_info" not in data:
                    raise EngineProtocolError(f"failed mid-stream: {data['error']}")
                out = merge_stream_chunk(out, data)
                yield out
        if out is None or not out.finish_reason:
            raise EngineProtocolError("ended the stream before the generation finished")

    async def abort(self, rid: str | None = None, *, abort_all: bool = False,
                    timeout: float | None | str = "default") -> None:
        """Abort one request (or a batch sent with this ``rid`` prefix), or every request."""
        await self._request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all}, timeout=timeout)

    async def pause(self, mode: str = "abort") -> None:
        """``mode``: ``"abort"`` | ``"retract"`` | ``"in_place"`` (SGLang's pause modes)."""
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def weight_version(self) -> int | str | None:
        return _version((await self._request("GET", "/get_weight_version")).get("weight_version"))

    async def update_weight_version(self, version: int | str, *, abort_all_requests: bool = False) -> None:
        await self._request("POST", "/update_weight_version",
                            {"new_version": str(version), "abort_all_requests": abort_all_requests})

    async def update_weights_from_tensor(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """POST an ``UpdateWeightsFromTensorReqInput`` body (``serialized_named_tensors``, ``load_format``,
        ``flush_cache``, ``weight_version``); integer versions are sent as strings, as SGLang expects."""
        body = dict(payload)
        if body.get("weight_version") is not None:
            body["weight_version"] = str(body["weight_version"])
        return await self._request("POST", "/update_weights_from_tensor", body, timeout=None)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Give the device memory of ``tags`` (``"weights"``, ``"kv_cache"``, ``"cuda_graph"``; all
        when ``None``) to a colocated trainer; generation is refused until it is resumed."""
        return await self._request("POST", "/release_memory_occupation", {"tags": list(tags)} if tags else {})

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Take back what :meth:`release_memory_occupation` gave."""
        return await self._request("POST", "/resume_memory_occupation", {"tags": list(tags)} if tags else {})

    async def health(self) -> bool:
        try:
            resp = await self._aclient().get("/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def model_info(self, timeout: float | None | str = "default") -> dict[str, Any]:
        return await self._request("GET", "/get_model_info", timeout=timeout)

    async def server_info(self, timeout: float | None | str = "default") -> dict[str, Any]:
        return await self._request("GET", "/get_server_info", timeout=timeout)

    async def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() > deadline:
                raise EngineError(503, f"engine not healthy after {timeout_s} s", "/health")
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------------------------------------
    # sync API
    # ------------------------------------------------------------------------------------------
    def generate_sync(self, input_ids: Sequence[Sequence[int]] | Sequence[int],
                      sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                      *, return_logprob: bool = True, rids: Sequence[str] | None = None) -> list[GenerationResult]:
        payload = self._with_adapter(self.generate_payload(input_ids, sampling_params, return_logprob=return_logprob,
                                                           rids=rids))
        return self._results(self._request_sync("POST", "/generate", payload), self._rid_list(payload))

    def abort_sync(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        self._request_sync("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    def pause_sync(self, mode: str = "abort") -> None:
        self._request_sync("POST", "/pause_generation", {"mode": mode})

    def resume_sync(self) -> None:
        self._request_sync("POST", "/continue_generation", {})

    def flush_cache_sync(self) -> None:
        self._request_sync("POST", "/flush_cache")

    def weight_version_sync(self) -> int | str | None:
        return _version(self._request_sync("GET", "/get_weight_version").get("weight_version"))

    def update_weights_from_tensor_sync(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        body = dict(payload)
        if body.get("weight_version") is not None:
            body["weight_version"] = str(body["weight_version"])
        return self._request_sync("POST", "/update_weights_from_tensor", body, timeout=None)

    def release_memory_occupation_sync(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        return self._request_sync("POST", "/release_memory_occupation", {"tags": list(tags)} if tags else {})

    def resume_memory_occupation_sync(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        return self._request_sync("POST", "/resume_memory_occupation", {"tags": list(tags)} if tags else {})

    def health_sync(self) -> bool:
        try:
            return self._sclient().get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False
