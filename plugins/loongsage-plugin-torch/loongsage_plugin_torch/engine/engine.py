"""The embedded rollout engine: model + continuous-batching loop + SGLang-compatible HTTP server.

``EmbeddedEngine(ctx)`` loads the policy of ``ctx.job`` (see :mod:`..modeling`) and, when the job
names one, its tokenizer; :meth:`EmbeddedEngine.start` starts the decode loop and the HTTP server
on ``ctx.host`` (port ``ctx.port``, 0 picks a free one) and returns the base URL (an address
beyond loopback needs the run secret, ``ctx.api_key``);
:meth:`EmbeddedEngine.shutdown` stops both. :meth:`EmbeddedEngine.load_weights` is the in-process
weight-update entry (used by the in-process transport); HTTP updates go through
``/update_weights_from_tensor``, whose ``load_format`` names a weight transport component.
With ``[train] lora`` an update may carry a LoRA adapter instead of full weights, over any
transport; the engine merges it into its weights, or with ``engine_args.lora_mode = "unmerged"``
applies it per request to the requests that name it (``lora_path = "policy"``), see :mod:`.adapter`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

from loongsage_core.backend_api.serving import check_listen_address
from loongsage_hookspecs import ComponentRef, EngineContext, WeightTransportContext

from ..lora import lora_scaling
from ..modeling import ModelLoadError, load_model, load_tokenizer, tokenizer_path, torch_dtype
from .adapter import ADAPTER_NAME, AdapterUpdater
from .protocol import InvalidRequest
from .runner import ModelRunner
from .scheduler import Scheduler
from .settings import EngineSettings
from .vision import VisionPreprocessor
from .weights import DIRECT_FORMAT, decode_direct

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)


def _eos_ids(model: Any, tokenizer: Any, vocab_size: int) -> set[int]:
    """End-of-sequence ids from the model config, its generation config and the tokenizer."""
    found: set[int] = set()
    sources = [getattr(model.config, "eos_token_id", None),
               getattr(getattr(model, "generation_config", None), "eos_token_id", None),
               getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None]
    for value in sources:
        for tid in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(tid, int) and 0 <= tid < vocab_size:
                found.add(tid)
    return found


class _LazyGrammar:
    """The engine's tokenizer as llguidance sees it, built on the first constrained request (about
    a second for a large vocabulary, which runs that never constrain do not pay)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._args = (tokenizer, vocab_size)

    def __getattr__(self, name: str) -> Any:
        from loongsage_core.backend_api.grammar import token_grammar

        return getattr(token_grammar(*self._args), name)


class EmbeddedEngine:
    """A rollout engine in this process that speaks SGLang's native HTTP API (see :mod:`.server`)."""

    def __init__(self, ctx: EngineContext, *, model: Any = None) -> None:
        self.ctx = ctx
        job = ctx.job
        self.settings = EngineSettings.from_job(job)
        self.model = model if model is not None else load_model(job)
        if self.settings.dtype is not None:  # the engine's own precision, apart from the trainer's
            self.model = self.model.to(torch_dtype(self.settings.dtype))
        self.tokenizer = None
        if job.model.tokenizer or job.model.path:
            try:
                self.tokenizer = load_tokenizer(job)
            except ModelLoadError:
                if job.model.tokenizer:
                    raise
                log.warning("embedded engine: no tokenizer in %s; responses carry empty text", job.model.path)
        self.model_path = job.model.path
        self.tokenizer_path = job.model.tokenizer or job.model.path
        self.runner = ModelRunner(self.model, num_slots=self.settings.max_batch_size,
                                  fp32_lm_head=bool(job.model.fp32_lm_head),
                                  packed_weights=self.settings.packed_weights)
        self.vocab_size = self.runner.vocab_size
        self.vision = VisionPreprocessor.for_model(
            self.model, tokenizer_path(job) if (job.model.tokenizer or job.model.path) else None)
        """Image preprocessing of a vision-language model (``None``: a text model)."""
        self.scheduler = Scheduler(self.runner, self.settings, _eos_ids(self.model, self.tokenizer, self.vocab_size))
        if self.tokenizer is not None:  # stop strings are matched on decoded text
            self.scheduler.decode = lambda ids: self.decode(ids, skip_special_tokens=False)
            self.scheduler.token_grammar = _LazyGrammar(self.tokenizer, self.vocab_size)
        lora = getattr(getattr(job, "train", None), "lora", None)
        self.lora_scaling = lora_scaling(lora) if lora is not None else None
        unmerged = self.settings.lora_mode == "unmerged" and self.lora_scaling is not None
        self.scheduler.adapter = AdapterUpdater(self.lora_scaling, self.runner if unmerged else None)
        self._receivers: dict[str, Any] = {}
        self._weight_groups: Any = None
        self._http: Any = None  # the ThreadedServer serving the HTTP API
        self.base_url: str | None = None

    # ------------------------------------------------------------------------------------------
    def start(self) -> str:
        """Start the decode loop and the HTTP server; returns ``http://HOST:PORT``."""
        if self.base_url is not None:
            return self.base_url
        from loongsage_core.backend_api.serving import ThreadedServer

        from .server import EngineServer

        api_key, host, port = self.ctx.api_key, self.ctx.host or "127.0.0.1", int(self.ctx.port or 0)
        check_listen_address(host, api_key, "embedded engine")
        self.scheduler.start()
        server = EngineServer(self, api_key=api_key)
        self._http = ThreadedServer(server.app, host=host, port=port, name="loongsage-engine-http")
        try:
            self.base_url = self._http.start()
        except Exception as exc:
            self.scheduler.stop()
            self._http = None
            raise RuntimeError(f"embedded engine: cannot serve on {host}:{port}: {exc}") from exc
        log.info("embedded engine serving at %s", self.base_url)
        return self.base_url

    def shutdown(self) -> None:
        """Stop the decode loop (pending requests fail with an error) and then the HTTP server."""
        self.scheduler.stop()
        if self._http is not None:
            self._http.stop()
        self._http = None
        self.base_url = None
        if self._weight_groups is not None:
            self._weight_groups.close()

    # ------------------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]], version: int) -> int:
        """Copy ``(name, tensor)`` pairs (Hugging Face names) into the model in place, between two
        decode steps, and set the weight version; returns the number of tensors copied.

        Thread-safe: callable from any thread while the engine serves. Requests kept across the
        update (pause ``in_place``) continue with the new weights; their later tokens carry ``version``.
        """
        return self.scheduler.call(lambda: self.scheduler.load_weights(named_tensors, int(version))).result()

    @property
    def weight_groups(self) -> Any:
        """The broadcast groups this engine joined (``transport.broadcast.BroadcastReceiver``)."""
        if self._weight_groups is None:
            from ..transport.broadcast import BroadcastReceiver

            self._weight_groups = BroadcastReceiver()
        return self._weight_groups

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters requests may name in ``lora_path``: the trained one, or none without
        ``[train] lora``. Merged (the default ``lora_mode``), naming it or not serves the same
        model; unmerged, a request that does not name it gets the base model."""
        return (ADAPTER_NAME,) if self.lora_scaling is not None else ()

    @property
    def weight_version(self) -> int:
        return self.scheduler.version

    def load_formats(self) -> list[str]:
        """The ``load_format`` values this engine accepts: ``direct``, every installed transport
        with a receiver (``/update_weights_from_tensor``) and ``broadcast``
        (``/update_weights_from_distributed``)."""
        formats = [DIRECT_FORMAT]
        components = self.ctx.components
        if components is not None:
            formats += sorted(name for name, spec in components.components("weight_transport").items()
                              if spec.receiver is not None and name != "broadcast")
        return formats + ["broadcast"]

    def named_tensors_from(self, load_format: str, payload: Mapping[str, Any]) -> Iterator[tuple[str, "torch.Tensor"]]:
        """The ``(name, tensor)`` pairs of an update request, decoded by ``load_format``."""
        if load_format == DIRECT_FORMAT:
            return decode_direct(payload)
        receiver = self._receivers.get(load_format)
        if receiver is None:
            components = self.ctx.components
            if components is None:
                raise InvalidRequest(f"'load_format' {load_format!r} is unknown: this engine has no weight "
                                     f"transports, only '{DIRECT_FORMAT}'", "load_format")
            try:
                spec = components.get("weight_transport", load_format)
            except Exception as exc:  # the registry says what is installed
                raise InvalidRequest(f"'load_format' {load_format!r} names no weight transport: {exc}",
                                     "load_format") from None
            if spec.receiver is None:
                raise InvalidRequest(f"'load_format' {load_format!r} names a weight transport without a receiver "
                                     "of its own (its sender uses other transports' formats)", "load_format")
            ctx = WeightTransportContext(where=f"weight update with load_format {load_format!r}", job=self.ctx.job,
                                         components=components, role="receiver")
            receiver = self._receivers[load_format] = components.bind(
                ComponentRef("weight_transport", load_format, where=ctx.where), ctx, using="receiver")
        return iter(receiver.receive(payload))

    # ------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest("'text' needs a tokenizer; send 'input_ids'", "text")
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

