"""Client of a rollout engine's SGLang-native HTTP API (the embedded engine or a real SGLang server).

The same field names go over the wire to both engines: ``/generate`` with ``input_ids`` (always
sent as a batch), ``sampling_params``, ``return_logprob`` and ``rid``; ``/abort_request``;
``/pause_generation``; ``/continue_generation``; ``/flush_cache``; ``/get_weight_version``;
``/update_weights_from_tensor``; ``/release_memory_occupation`` / ``/resume_memory_occupation``;
``/health``. Answers are read by :mod:`loongsage_core.engine_results` (:class:`GenerationResult`,
:func:`merge_stream_chunk`, :class:`EngineError`, :class:`EngineProtocolError`, re-exported here):
a 4xx/5xx answer raises :class:`EngineError` with the engine's own message.

Every call is async (``await client.generate(...)``, httpx.AsyncClient); ``generate_sync`` is the
one blocking twin (httpx.Client), for benchmarks and threads without an event loop.

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

import httpx

from .engine_results import (
    EngineError,
    EngineProtocolError,
    GenerationResult,
    as_version,
    check_response,
    json_or_text,
    merge_stream_chunk,
)
from .security import engine_headers

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["EngineClient", "EngineError", "EngineProtocolError", "GenerationResult", "encode_direct_tensors",
           "merge_stream_chunk"]


def encode_direct_tensors(named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> str:
    """``serialized_named_tensors`` for ``load_format="direct"`` of the embedded engine:
    base64 of ``torch.save`` of the ``(name, tensor)`` list (tensors moved to CPU)."""
    import torch

    buf = io.BytesIO()
    torch.save([(name, t.detach().cpu().contiguous()) for name, t in named_tensors], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class EngineClient:
    """Talks to one engine at ``base_url`` (``http://host:port``)."""

    def __init__(self, base_url: str, *, timeout: float | None = 600.0, api_key: str | None = None,
                 max_connections: int | None = 100, lora_path: str | None = None,
                 return_routed_experts: bool = False) -> None:
        """``lora_path``: the LoRA adapter every ``/generate`` names (SGLang's per-request adapter;
        a LoRA run's :data:`~loongsage_hookspecs.LORA_ADAPTER_NAME`), ``None`` for the base model.
        ``return_routed_experts``: every ``/generate`` asks a mixture-of-experts engine for the
        experts it routed each token to (:attr:`GenerationResult.routed_experts`; Router Replay)."""
        self.base_url = base_url.rstrip("/")
        self.lora_path = lora_path
        self.return_routed_experts = return_routed_experts
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
        return json_or_text(check_response(resp, path))

    def _request_sync(self, method: str, path: str, json: Any = None, timeout: float | None | str = "default") -> Any:
        kw: dict[str, Any] = {} if timeout == "default" else {"timeout": timeout}
        resp = self._sclient().request(method, path, json=json, **kw)
        return json_or_text(check_response(resp, path))

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
                         top_logprobs_num: int = 0,
                         logprob_start_len: int | Sequence[int] | None = None,
                         priority: int | None = None) -> dict[str, Any]:
        """The ``/generate`` body for a batch (a single prompt is sent as a batch of one);
        ``top_logprobs_num`` asks for that many most likely tokens per position;
        ``logprob_start_len`` (one for all prompts or one per prompt; -1: none) for the log-probs of
        the prompt's tokens from that position on (``meta_info.input_token_logprobs``);
        ``priority``: SGLang's request priority, larger admitted sooner (SGLang honours it with
        ``--enable-priority-scheduling``, the embedded engine always)."""
        extra: dict[str, Any] = {"top_logprobs_num": top_logprobs_num} if top_logprobs_num else {}
        if priority is not None:
            extra["priority"] = int(priority)
        if logprob_start_len is not None:
            extra["logprob_start_len"] = logprob_start_len if isinstance(logprob_start_len, int) \
                else [int(x) for x in logprob_start_len]
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
            if isinstance(extra.get("logprob_start_len"), list):
                extra["logprob_start_len"] = extra["logprob_start_len"][0]
            return {"input_ids": batch[0], "sampling_params": single, "return_logprob": return_logprob,
                    "rid": rids[0], **extra}
        return {"input_ids": batch, "sampling_params": params, "return_logprob": return_logprob,
                "rid": list(rids), **extra}

    def _with_adapter(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` naming this client's LoRA adapter (``lora_path``), when it has one, and
        asking for the routed experts when this client does."""
        if self.lora_path is not None:
            payload["lora_path"] = self.lora_path
        if self.return_routed_experts:
            payload["return_routed_experts"] = True
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
                       top_logprobs_num: int = 0, image_data: Sequence[str] | None = None,
                       logprob_start_len: int | Sequence[int] | None = None,
                       priority: int | None = None) -> list[GenerationResult]:
        """Generate for every prompt of ``input_ids``; results in prompt order. ``image_data``
        (one prompt only): its images in token order, base64 (SGLang's ``image_data``);
        ``logprob_start_len``: see :meth:`generate_payload` (the scores are in each result's
        ``meta_info``); ``priority``: see :meth:`generate_payload`."""
        payload = self._with_adapter(self.generate_payload(input_ids, sampling_params, return_logprob=return_logprob,
                                                           rids=rids, top_logprobs_num=top_logprobs_num,
                                                           logprob_start_len=logprob_start_len, priority=priority))
        if image_data:
            payload["image_data"] = list(image_data)
        body = await self._request("POST", "/generate", payload)
        return self._results(body, self._rid_list(payload))

    async def generate_stream(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any] | None = None,
                              *, rid: str, return_logprob: bool = True, top_logprobs_num: int = 0,
                              image_data: Sequence[str] | None = None,
                              priority: int | None = None) -> AsyncGenerator[GenerationResult, None]:
        """Generate for one prompt with ``stream: true``; yields the whole generation so far after
        every chunk (SGLang's server-sent events), the last one with its finish reason.

        Leaving the iteration early closes the connection, which aborts the request at the engine.
        A stream that breaks off or carries an error is an :class:`EngineProtocolError`.
        """
        payload = {**self._with_adapter(self.generate_payload(input_ids, sampling_params, return_logprob=return_logprob,
                                                              rids=[rid], top_logprobs_num=top_logprobs_num,
                                                              priority=priority)),
                   "stream": True}
        if image_data:
            payload["image_data"] = list(image_data)
        out: GenerationResult | None = None
        async with self._aclient().stream("POST", "/generate", json=payload) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                check_response(resp, "/generate")
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
        return as_version((await self._request("GET", "/get_weight_version")).get("weight_version"))

    async def update_weight_version(self, version: int | str, *, abort_all_requests: bool = False) -> None:
        await self._request("POST", "/update_weight_version",
                            {"new_version": str(version), "abort_all_requests": abort_all_requests})

    @staticmethod
    def update_weights_from_disk_body(model_path: str, *, load_format: str | None = None,
                                      weight_version: int | str | None = None, flush_cache: bool = True,
                                      abort_all_requests: bool = False) -> dict[str, Any]:
        """SGLang's ``UpdateWeightFromDiskReqInput`` as JSON (fields left at ``None`` are not sent:
        the engine uses its defaults; versions are sent as strings, SGLang's type)."""
        fields = {"model_path": str(model_path), "load_format": load_format,
                  "weight_version": None if weight_version is None else str(weight_version),
                  "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        return {key: value for key, value in fields.items() if value is not None}

    async def update_weights_from_disk(self, model_path: str, *, weight_version: int | str | None = None,
                                       flush_cache: bool = True) -> dict[str, Any]:
        """SGLang's ``/update_weights_from_disk``: the engine loads the weights of the Hugging Face
        directory ``model_path`` (on its machine; the served model's architecture) in place."""
        body = self.update_weights_from_disk_body(model_path, weight_version=weight_version, flush_cache=flush_cache)
        out = await self._request("POST", "/update_weights_from_disk", body, timeout=None)
        if isinstance(out, Mapping) and out.get("success") is False:  # SGLang's failure shape
            raise EngineError(400, str(out.get("message") or "failed"), "/update_weights_from_disk")
        return dict(out) if isinstance(out, Mapping) else {}

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
                      *, return_logprob: bool = True, rids: Sequence[str] | None = None,
                      priority: int | None = None) -> list[GenerationResult]:
        payload = self._with_adapter(self.generate_payload(input_ids, sampling_params, return_logprob=return_logprob,
                                                           rids=rids, priority=priority))
        return self._results(self._request_sync("POST", "/generate", payload), self._rid_list(payload))
