"""Embedded rollout engine of loongsage-plugin-torch.

A CPU-friendly inference server for the policy model that speaks the subset of SGLang's native
HTTP API the framework uses (``/generate`` with ``input_ids`` and ``return_logprob``,
``/abort_request``, ``/pause_generation``, ``/continue_generation``, ``/flush_cache``,
``/update_weights_from_tensor``, ``/update_weights_from_distributed``, ``/get_weight_version``,
...), with continuous batching, a slot KV cache, prefix sharing across a group's samples and per-token weight versions.

Modules: :mod:`.engine` (the engine object and factory); HTTP: :mod:`.server` (routes,
generation, control), :mod:`.weight_endpoints` (weight updates), :mod:`.response_json`
(``/generate`` answers), :mod:`.http_common`; the batching loop: :mod:`.scheduler` (thread,
commands), :mod:`.batch_step` (prefill, decode, retire), :mod:`.request_state`; request
validation: :mod:`.protocol` (``/generate``), :mod:`.control_protocol` (control endpoints),
:mod:`.request_checks`; :mod:`.runner` (forward passes), :mod:`.kv_cache`, :mod:`.sampling`,
:mod:`.adapter`, :mod:`.weights`, :mod:`.settings`.
Importing this package does not import torch; the modules that need it import it when used.
"""

from __future__ import annotations

from typing import Any

from loongsage_hookspecs import EngineContext


def create_engine(ctx: EngineContext) -> Any:
    """``factory(ctx: EngineContext) -> EmbeddedEngine`` of the ``torch`` rollout engine."""
    from .engine import EmbeddedEngine

    return EmbeddedEngine(ctx)


def check_engine_args(job: Any) -> None:
    """``RolloutEngineSpec.check_job`` of the ``torch`` engine: its ``[rollout] engine_args``
    (:class:`~.settings.EngineSettings`), checked at validation without building anything."""
    from .settings import EngineSettings

    EngineSettings.from_job(job)


__all__ = ["check_engine_args", "create_engine"]
