"""The HTTP front of the embedded engine: SGLang's native endpoints, served by aiohttp.

Paths and JSON fields follow SGLang so that one client drives both engines:

=============================  ==========================================================
``POST /generate``             ``input_ids`` (one prompt or a batch), ``sampling_params``
                               (``stop`` strings too), ``return_logprob``, ``top_logprobs_num``,
                               ``return_routed_experts``, ``rid``, ``stream`` -> ``text``,
                               ``output_ids``, ``meta_info``
                               (one object, or a list for a batch); with ``stream`` server-sent
                               events ``data: {...}`` carrying the cumulative ``text``,
                               ``output_ids`` and ``meta_info`` after each token
                               (``finish_reason`` null until the last), then ``data: [DONE]``
``POST /abort_request``        ``{"rid", "abort_all"}``
``POST /pause_generation``     ``{"mode": "abort" | "retract" | "in_place"}``
``POST /continue_generation``
``GET|POST /flush_cache``
``GET /get_weight_version``    ``{"weight_version"}``
``POST /get_weights_by_name``  ``{"name", "truncate_size"}``: a parameter's first values (floats)
``POST /update_weight_version`` ``{"new_version", "abort_all_requests"}``
``POST /update_weights_from_tensor``  ``{"serialized_named_tensors", "load_format",
                               "flush_cache", "weight_version"}``
``POST /update_weights_from_disk``  ``{"model_path", "load_format", "flush_cache",
                               "weight_version"}``: the weights of a Hugging Face directory
``POST /init_weights_update_group``  ``{"master_address", "master_port", "rank_offset",
                               "world_size", "group_name", "backend"}`` (joins a broadcast group)
``POST /update_weights_from_distributed``  ``{"names", "dtypes", "shapes", "group_name",
                               "flush_cache", "weight_version"}``, or ``load_format = "broadcast"``
                               with a flat ``bucket`` (see ``transport.broadcast``)
``POST /destroy_weights_update_group``  ``{"group_name"}``
``POST /release_memory_occupation``  ``{"tags"}`` (``weights``, ``kv_cache``, ``cuda_graph``; all
                               when omitted): frees the KV cache; generation is refused until
``POST /resume_memory_occupation``   ``{"tags"}`` takes every released tag back
``GET /health``, ``GET /health_generate``, ``GET /get_model_info``, ``GET /get_server_info``
=============================  ==========================================================

Authentication: an engine built with the run secret (``EngineContext.api_key``) answers only its
health probes without it; every other request (generation included: it is cheap to check and
keeps agents off the engines) needs ``Authorization: Bearer <secret>`` or ``x-api-key``, as SGLang
with ``--api-key`` and ``--admin-api-key`` does, and gets a 401 otherwise.

``meta_info`` carries SGLang's ``id``, ``finish_reason``, ``prompt_tokens``,
``completion_tokens``, ``cached_tokens``, ``e2e_latency``, ``weight_version`` and
``weight_versions`` (spans ``{"version", "start", "end"}`` over the output tokens), the
``output_token_logprobs`` triples when asked, ``output_top_logprobs`` (per token the
``top_logprobs_num`` most likely ``[logprob, token_id, null]``) when asked, with
``logprob_start_len`` >= 0 also ``input_token_logprobs`` (the prompt's tokens from that position
on, ``null`` at position 0) and ``input_top_logprobs`` (:mod:`.prompt_logprobs`), ``routed_experts``
(a mixture-of-experts model, when asked: base64 of int32 ``[positions, layers, top_k]`` expert
ids, row-major, for every position the model ran, the prompt and the output but its last token;
-1 in dense layers; ``routed_experts_dtype`` says ``"int32"``; with the final answer only), and
one LoongSage extension:
``output_token_weight_versions``, the integer weight version of every output token.
Weight versions are integers inside LoongSage; ``weight_version`` is sent as a string, the type
SGLang uses.

The code behind the table: this module routes every path and answers generation, pausing,
memory and status; :mod:`.weight_endpoints` answers the weight paths; :mod:`.response_json`
builds ``/generate``'s answer; :mod:`.http_common` holds the engine's shape and JSON I/O.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

from aiohttp import web

from loongsage_core.backend_api.distributed import node_id
from loongsage_core.backend_api.serving import secret_middleware

from .control_protocol import MEMORY_TAGS, parse_abort, parse_memory_tags, parse_pause
from .http_common import ServedEngine, error_response, read_json_body
from .protocol import parse_generate
from .request_checks import InvalidRequest
from .request_state import EngineStopped, MemoryBusy, MemoryReleased, RidInUse
from .response_json import response_body
from .weight_endpoints import WeightEndpointsMixin
from .weights import WeightUpdateError

log = logging.getLogger(__name__)


class EngineServer(WeightEndpointsMixin):
    """aiohttp application over a :class:`ServedEngine` (the :class:`~.engine.EmbeddedEngine`)."""

    def __init__(self, engine: ServedEngine, api_key: str | None = None) -> None:
        self.engine = engine
        self.api_key = api_key
        self.app = web.Application(client_max_size=engine.settings.max_request_mb * 1024 * 1024,
                                   middlewares=[secret_middleware(api_key, self._refuse), self._errors])
        r = self.app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_post("/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/release_memory_occupation", self.release_memory_occupation)
        r.add_post("/resume_memory_occupation", self.resume_memory_occupation)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/get_model_info", self.get_model_info)
        r.add_get("/get_server_info", self.get_server_info)
        # newer SGLang names of the same endpoints (sglang-router probes these)
        r.add_get("/model_info", self.get_model_info)
        r.add_get("/server_info", self.get_server_info)

    @staticmethod
    def _refuse(request: web.Request, token: str | None) -> web.Response:
        return error_response(401, f"{request.method} {request.path} needs the run secret "
                           "('Authorization: Bearer <secret>')", "authentication_error")

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except InvalidRequest as exc:
            return web.json_response(exc.to_json(), status=400)
        except WeightUpdateError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        except (EngineStopped, MemoryReleased) as exc:
            return error_response(503, str(exc), "server_error")
        except MemoryBusy as exc:
            return error_response(400, str(exc), "invalid_request_error")
        except web.HTTPRequestEntityTooLarge as exc:
            return error_response(413, f"request body too large: {exc.text}", "invalid_request_error")
        except web.HTTPException:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the client gets the message instead of a bare 500
            log.exception("embedded engine: %s failed", request.path)
            return error_response(500, f"{type(exc).__name__}: {exc}", "server_error")

    # ------------------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        engine = self.engine
        body = await read_json_body(request)
        items, single = parse_generate(body, vocab_size=engine.vocab_size,
                                       max_context=engine.settings.max_context_length, encode=engine.encode,
                                       can_decode=engine.tokenizer is not None, adapters=engine.adapter_names,
                                       routes_experts=bool(engine.runner.moe_layers),
                                       takes_images=engine.vision is not None)
        for i, item in enumerate(items):
            if item.image_data:
                assert engine.vision is not None
                item.vision = engine.vision.prepare(item.input_ids, item.image_data,
                                                    "image_data" if single else f"image_data[{i}]")
        if items[0].stream:
            return await self._generate_stream(request, items[0])
        futures = engine.scheduler.submit(items)
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except asyncio.CancelledError:  # the client went away: stop its requests
            self._abort_items(items, "client disconnected")
            raise
        except RidInUse as exc:  # the rest of the batch is not wanted either
            self._abort_items(items, "batch rejected")
            raise InvalidRequest(str(exc), "rid") from None
        outs = [response_body(self.engine, item, res) for item, res in zip(items, results)]
        return web.json_response(outs[0] if single else outs)

    async def _generate_stream(self, request: web.Request, item: Any) -> web.StreamResponse:
        """One request, streamed: a ``data:`` event per generated token with everything so far.

        The event stream opens with the first token, so a request refused before it (rid in use,
        memory released) gets an ordinary error answer.
        """
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Any] = asyncio.Queue()
        [future] = self.engine.scheduler.submit([item], progress=lambda res: loop.call_soon_threadsafe(
            updates.put_nowait, res))
        done = asyncio.wrap_future(future)
        response: web.StreamResponse | None = None

        async def send(states: list[Any], end: bytes = b"") -> None:
            nonlocal response
            if response is None:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
                await response.prepare(request)
            events = (b"data: " + json.dumps(response_body(self.engine, item, state)).encode() + b"\n\n"
                      for state in states)
            await response.write(b"".join(events) + end)

        try:
            while not done.done():
                getter = asyncio.ensure_future(updates.get())
                await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                states = [getter.result()]
                while not updates.empty():  # one event per step (SGLang's stream_interval 1)
                    states.append(updates.get_nowait())
                await send(states)
            try:
                final = done.result()
            except RidInUse as exc:
                raise InvalidRequest(str(exc), "rid") from None
            await send([final], b"data: [DONE]\n\n")
            assert response is not None
            await response.write_eof()
            return response
        except BaseException as exc:  # the client went away (or the engine failed): stop the request
            self._abort_items([item], "client disconnected")
            if isinstance(exc, ConnectionError) and response is not None:
                log.debug("embedded engine: the client of stream %s left", item.rid)
                return response  # nobody to tell
            if response is not None and not isinstance(exc, asyncio.CancelledError):
                message = str(exc) if isinstance(exc, (EngineStopped, MemoryReleased)) else type(exc).__name__
                await response.write(b"data: " + json.dumps({"error": {"message": message}}).encode() + b"\n\n")
                return response
            raise

    def _abort_items(self, items: list[Any], message: str) -> None:
        sched = self.engine.scheduler
        rids = [item.rid for item in items]

        def abort() -> None:
            for rid in rids:
                sched.abort(rid, False, message)

        sched.call(abort)

    async def abort_request(self, request: web.Request) -> web.Response:
        rid, abort_all = parse_abort(await read_json_body(request))
        sched = self.engine.scheduler
        count = await self._run(lambda: sched.abort(rid, abort_all, "aborted by abort_request"))
        return web.json_response({"success": True, "num_aborted": count})

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = parse_pause(await read_json_body(request))
        sched = self.engine.scheduler
        await self._run(lambda: sched.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok", "mode": mode})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_json_body(request)
        await self._run(self.engine.scheduler.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        await self._run(self.engine.scheduler.flush_cache)
        return web.Response(text="Cache flushed.\n")

    # -- colocated runs: memory given to the trainer while it trains ----------------------------
    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = parse_memory_tags(await read_json_body(request), "/release_memory_occupation", MEMORY_TAGS)
        released = await self._run(lambda: self.engine.scheduler.release_memory(tags))
        return web.json_response({"success": True, "message": f"Released {', '.join(tags)}.",
                                  "memory_released": released})

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = parse_memory_tags(await read_json_body(request), "/resume_memory_occupation", MEMORY_TAGS)
        released = await self._run(lambda: self.engine.scheduler.resume_memory(tags))
        return web.json_response({"success": True, "message": f"Resumed {', '.join(tags)}.",
                                  "memory_released": released})

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.scheduler.alive:
            return web.Response(status=503, text="engine loop is not running\n")
        return web.Response(status=200)

    async def get_model_info(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response({
            "model_path": e.model_path, "tokenizer_path": e.tokenizer_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": str(e.scheduler.version),
            "max_context_length": e.settings.max_context_length, "vocab_size": e.vocab_size,
            "model_type": e.runner.config.model_type,
        })

    async def get_server_info(self, request: web.Request) -> web.Response:
        e = self.engine
        state = await self._run(e.scheduler.snapshot)
        return web.json_response({
            "engine": "loongsage-torch", "max_batch_size": e.settings.max_batch_size,
            "max_prefill_tokens": e.settings.max_prefill_tokens, "context_length": e.settings.max_context_length,
            "prefix_cache_tokens": e.settings.prefix_cache_tokens, "internal_states": [state],
            # what a weight sender needs to pick its path to this engine
            "node_id": node_id(), "pid": os.getpid(), "device": str(next(e.model.parameters()).device),
            "weight_load_formats": e.load_formats(),
        })
