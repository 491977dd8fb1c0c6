"""The HTTP API the ``tinker`` SDK (0.38) talks to, on aiohttp, behind the service's API key.

The SDK sends its key as ``X-API-Key`` (keys start with ``tml-``). JSON bodies are validated with
the SDK's own request models (``tinker.types``), so a field this service does not know fails as
it would against Tinker. Training and sampling calls answer a future (:mod:`.futures`); the
session, config and telemetry calls the SDK makes on its own are answered directly. The client
configuration this service returns turns off what it does not implement (JWT exchange, custom
losses on the server, the batched futures poller, joined sampling sessions), so the SDK falls
back to the plain paths. Other endpoints answer 404 with a one-line ``detail``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Awaitable, Callable

from aiohttp import web

from .batches import TinkerRequestError
from .futures import FutureStore
from .sampling import prompt_scores_from
from .service import SamplingSession, TinkerService
from .trainer import ModelSpec
from .wire import decode_forward_backward, encode_forward_backward_output, encode_sample_response

PROTOBUF = "application/x-protobuf"

CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "parallel_fwdbwd_chunks": False,
                 "proto_compress_fwdbwd": False, "use_pyqwest_transport": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}
"""The SDK's feature flags as this service sets them (see the module docstring)."""


def _error(status: int, detail: str) -> web.Response:
    return web.json_response({"detail": detail}, status=status)


async def _parse(request: web.Request, model: Any) -> Any:
    """The JSON body as ``model`` (a ``tinker.types`` request class); 400 with the problem otherwise."""
    try:
        return model.model_validate(await request.json())
    except ValueError as exc:  # pydantic's ValidationError, or a body that is not JSON
        detail = f"{request.path}: {' '.join(str(exc).splitlines()[:3])}"
        raise web.HTTPBadRequest(text=json.dumps({"detail": detail}), content_type="application/json") from None


class TinkerApp:
    """The routes of :mod:`.app` over a :class:`TinkerService`."""

    def __init__(self, service: TinkerService, api_key: str) -> None:
        self.service = service
        self.api_key = api_key
        self.futures = FutureStore()
        self.sessions: set[str] = set()

    def build(self) -> web.Application:
        from loongsage_core.backend_api.serving import presented_token, token_matches

        @web.middleware
        async def check_key(request: web.Request, handler: Any) -> Any:
            if request.path == "/api/v1/healthz":
                return await handler(request)
            token = request.headers.get("X-API-Key") or presented_token(request.headers)
            if not token_matches(token, self.api_key):
                return _error(401, "missing or wrong API key (set TINKER_API_KEY to the key tinker-serve printed)")
            return await handler(request)

        app = web.Application(middlewares=[check_key], client_max_size=1 << 30)
        get, post = app.router.add_get, app.router.add_post
        get("/api/v1/healthz", self.healthz)
        post("/api/v1/client/config", self.client_config)
        post("/api/v1/client/dynamic_config", self.dynamic_config)
        post("/api/v1/create_session", self.create_session)
        post("/api/v1/session_heartbeat", self.heartbeat)
        post("/api/v1/sessions/{session_id}/finish", self.finish_session)
        post("/api/v1/telemetry", self.telemetry)
        get("/api/v1/get_server_capabilities", self.capabilities)
        post("/api/v1/create_model", self.create_model)
        post("/api/v1/get_info", self.get_info)
        post("/api/v1/forward_backward", self.forward_backward)
        post("/api/v1/optim_step", self.optim_step)
        post("/api/v1/save_weights", self.save_weights)
        post("/api/v1/load_weights", self.load_weights)
        post("/api/v1/save_weights_for_sampler", self.save_weights_for_sampler)
        post("/api/v1/create_sampling_session", self.create_sampling_session)
        post("/api/v1/asample", self.asample)
        get("/api/v1/samplers/{sampler_id}", self.get_sampler)
        post("/api/v1/retrieve_future", self.retrieve_future)
        post("/api/v1/cancel_future", self.cancel_future)
        post("/api/v1/unload_model", self.unload_model)
        app.router.add_route("*", "/{tail:.*}", self.unsupported)
        app.on_cleanup.append(lambda _app: self.service.close())
        return app

    def _future(self, work: Callable[[], Awaitable[Any]], kind: str, model_id: str | None = None,
                **extra: Any) -> web.Response:
        request_id = self.futures.submit(work, kind)
        body: dict[str, Any] = {"request_id": request_id, **extra}
        if model_id is not None:
            body["model_id"] = model_id
        return web.json_response(body)

    # -- session, config, telemetry -----------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def client_config(self, request: web.Request) -> web.Response:
        return web.json_response(CLIENT_CONFIG)

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response({"sample_cancel_enabled": False})

    async def create_session(self, request: web.Request) -> web.Response:
        session_id = f"session-{uuid.uuid4().hex}"
        self.sessions.add(session_id)
        return web.json_response({"type": "create_session", "session_id": session_id})

    async def heartbeat(self, request: web.Request) -> web.Response:
        return web.json_response({"type": "session_heartbeat"})

    async def finish_session(self, request: web.Request) -> web.Response:
        """The client closed its session: its training models are unloaded (their checkpoints stay)."""
        session_id = request.match_info["session_id"]
        self.sessions.discard(session_id)
        for model_id in [m for m in self.service.training if m.startswith(f"{session_id}:train:")]:
            await self.service.unload(model_id)
        return web.json_response({})

    async def telemetry(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "accepted"})

    async def capabilities(self, request: web.Request) -> web.Response:
        models = [{"model_name": name, "trainable": True, "sampleable": True} for name in sorted(self.service.models)]
        return web.json_response({"supported_models": models})

    async def unsupported(self, request: web.Request) -> web.Response:
        return _error(404, f"{request.method} {request.path} is not supported by this LoongSage Tinker service")

    # -- training -----------------------------------------------------------------------------------

    async def create_model(self, request: web.Request) -> web.Response:
        from tinker import types

        req = await _parse(request, types.CreateModelRequest)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"

        async def work() -> dict[str, Any]:
            if req.optimizer_config.type != "adamw":
                raise TinkerRequestError(f"optimizer {req.optimizer_config.type!r} is not supported (adamw only)")
            lora = req.lora_config
            if lora is not None and not (lora.train_mlp and lora.train_attn and lora.train_unembed):
                raise TinkerRequestError("LoRA on a subset of layers (train_mlp / train_attn / train_unembed = "
                                         "False) is not supported: adapters go on every linear layer")
            rank = None if lora is None or lora.rank == 0 else int(lora.rank)
            spec = ModelSpec(name=req.base_model, path=self.service.model_path(req.base_model), lora_rank=rank,
                             seed=None if lora is None else lora.seed)
            await self.service.create_model(model_id, spec)
            return {"model_id": model_id, "type": "create_model"}

        return self._future(work, "create_model", model_id)

    async def get_info(self, request: web.Request) -> web.Response:
        from tinker import types

        req = await _parse(request, types.GetInfoRequest)
        try:
            spec = self.service.entry(req.model_id).model.spec
        except TinkerRequestError as exc:
            return _error(404, str(exc))
        return web.json_response({"type": "get_info", "model_id": req.model_id, "model_name": spec.name,
                                  "is_lora": spec.lora_rank is not None, "lora_rank": spec.lora_rank,
                                  "model_data": {"arch": "transformers", "model_name": spec.name,
                                                 "tokenizer_id": spec.path}})

    async def forward_backward(self, request: web.Request) -> web.Response:
        try:
            req = decode_forward_backward(await request.read(), request.headers.get("Content-Encoding"))
        except TinkerRequestError as exc:
            return _error(400, str(exc))

        async def work() -> bytes:
            outputs, metrics = await self.service.in_order(
                req.model_id, req.seq_id,
                lambda e: e.model.forward_backward(req.data, req.loss_fn, req.loss_fn_config,
                                                   forward_only=req.forward_only))
            return encode_forward_backward_output(outputs, metrics)

        return self._future(work, "forward" if req.forward_only else "forward_backward", req.model_id)

    async def optim_step(self, request: web.Request) -> web.Response:
        from tinker import types

        req = await _parse(request, types.OptimStepRequest)

        async def work() -> dict[str, Any]:
            if not isinstance(req.optim_params, types.AdamParams):
                raise TinkerRequestError(f"optimizer params of type {req.optim_params.type!r} are not supported "
                                         "(AdamParams only)")
            params = req.optim_params.model_dump()
            metrics = await self.service.in_order(req.model_id, req.seq_id, lambda e: e.model.optim_step(params))
            return {"metrics": metrics}

        return self._future(work, "optim_step", req.model_id)

    async def save_weights(self, request: web.Request) -> web.Response:
        from tinker import types

        req = await _parse(request, types.SaveWeightsRequest)

        async def work() -> dict[str, Any]:
            return {"path": await self.service.save_state(req.model_id, req.seq_id, req.path), "type": "save_weights"}

        return self._future(work, "save_weights", req.model_id)

    async def load_weights(self, request: web.Request) -> web.Response:
        from tinker import types

        req = await _parse(request, types.LoadWeightsRequest)
        model_id = req.model_id or f"{req.session_id}:train:{req.model_seq_id}"

        async def work() -> dict[str, Any]:
            seq_id = req.seq_id
            if req.model_id is None:  # create-via-load: the checkpoint says which model
                spec = self.service.read_meta(self.service.checkpoint_dir(req.path, "weights"))
                if req.base_model is not None and req.base_model != spec.name:
                    raise TinkerRequestError(f"base_model {req.base_model!r} does not match the checkpoint's "
                                             f"{spec.name!r}")
                spec.path = self.service.model_path(spec.name)
                await self.service.create_model(model_id, spec)
                seq_id = None
            await self.service.load_state(model_id, seq_id, req.path, optimizer=req.optimizer)
            return {"path": req.path, "model_id": model_id, "type": "load_weights"}

        return self._future(work, "load_weights", model_id)

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        from tinker import types

        req = await _parse(request, types.SaveWeightsForSamplerRequest)

        async def work() -> dict[str, Any]:
            if req.kind != "snapshot":
                raise TinkerRequestError(f"sampling client kind {req.kind!r} is not supported (snapshot only)")
            path, directory = await self.service.save_for_sampler(req.model_id, req.seq_id, req.path)
            if req.path is not None:
                return {"path": path, "type": "save_weights_for_sampler"}
            base_model = self.service.entry(req.model_id).model.spec.name
            session = SamplingSession(weights_dir=str(directory), base_model=base_model, model_path=path)
            return {"path": path, "sampling_session_id": self.service.new_sampling_session(session),
                    "type": "save_weights_for_sampler"}

        return self._future(work, "save_weights_for_sampler", req.model_id)

    async def unload_model(self, request: web.Request) -> web.Response:
        from tinker import types

        req = await _parse(request, types.UnloadModelRequest)

        async def work() -> dict[str, Any]:
            await self.service.unload(req.model_id)
            return {"model_id": req.model_id, "type": "unload_model"}

        return self._future(work, "unload_model", req.model_id)

    # -- sampling -----------------------------------------------------------------------------------

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        from tinker import types

        req = await _parse(request, types.CreateSamplingSessionRequest)
        try:
            target = self.service.sampling_target(req.base_model, req.model_path)
        except TinkerRequestError as exc:
            return _error(400, str(exc))
        return web.json_response({"type": "create_sampling_session",
                                  "sampling_session_id": self.service.new_sampling_session(target)})

    async def get_sampler(self, request: web.Request) -> web.Response:
        sampler_id = request.match_info["sampler_id"]
        session = self.service.sampling_sessions.get(sampler_id)
        if session is None:
            return _error(404, f"sampler {sampler_id!r} is unknown")
        return web.json_response({"sampler_id": sampler_id, "base_model": session.base_model,
                                  "model_path": session.model_path})

    async def asample(self, request: web.Request) -> web.Response:
        from tinker import types

        req = await _parse(request, types.SampleRequest)

        async def work() -> bytes:
            refused = [name for name, on in (("target_prompt_logprobs", req.target_prompt_logprobs is not None),
                                             ("prompt_alt_tokens_k", req.prompt_alt_tokens_k)) if on]
            if refused:
                raise TinkerRequestError(f"sample: {', '.join(refused)} is not supported by this service")
            if req.sampling_session_id is not None:
                if req.sampling_session_id not in self.service.sampling_sessions:
                    raise TinkerRequestError(f"sampling session {req.sampling_session_id!r} is unknown")
                weights = self.service.sampling_sessions[req.sampling_session_id].weights_dir
            else:
                weights = self.service.sampling_target(req.base_model, req.model_path).weights_dir
            tokens: list[int] = []
            for chunk in req.prompt.chunks:
                if getattr(chunk, "type", None) != "encoded_text":
                    raise TinkerRequestError(f"sample: prompt chunks of type {getattr(chunk, 'type', '?')!r} are "
                                             "not supported (text only)")
                tokens.extend(int(t) for t in chunk.tokens)
            if not tokens:
                raise TinkerRequestError("sample: the prompt is empty")
            params = req.sampling_params.model_dump()
            prompt_from = prompt_scores_from(req, len(tokens))
            top_k = max(int(req.topk_prompt_logprobs or 0), int(req.topk_sample_logprobs or 0))
            sampled = await self.service.engines.sample(weights, tokens, int(req.num_samples), params,
                                                        prompt_from=prompt_from, top_k=top_k)
            return encode_sample_response(sampled, topk_sample=int(req.topk_sample_logprobs or 0),
                                          topk_prompt=int(req.topk_prompt_logprobs or 0))

        ids = [f"seq-{uuid.uuid4().hex}" for _ in range(int(req.num_samples))]
        return self._future(work, "sample", sample_sequence_ids=ids)

    # -- futures ------------------------------------------------------------------------------------

    async def retrieve_future(self, request: web.Request) -> web.Response:
        body = await request.json()
        request_id = str(body.get("request_id", ""))
        try:
            outcome = await self.futures.retrieve(request_id)
        except KeyError:
            return _error(404, f"request_id {request_id!r} is unknown")
        if outcome is None:
            return web.json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if outcome.error is not None:
            return web.json_response({"error": outcome.error, "category": outcome.category})
        if isinstance(outcome.body, bytes):
            return web.Response(body=outcome.body, content_type=PROTOBUF)
        return web.json_response(outcome.body)

    async def cancel_future(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.futures.cancel(str(body.get("request_id", "")))
        return web.json_response({})
