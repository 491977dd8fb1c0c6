"""LoongSage plugin: SGLang rollout engine backend: server actors, native HTTP API, weight updates.

Components (see :mod:`.plugin`): the ``sglang`` rollout engine (:mod:`.server`, command line in
:mod:`.launch`), the ``sglang_disk`` (:mod:`.transport_disk`), ``sglang_nccl``
(:mod:`.transport_nccl`) and ``sglang_tensor`` (:mod:`.transport_tensor`) weight transports;
plus SGLang control calls (:mod:`.client`) and sglang-router management (:mod:`.router`).
Importing this package imports neither SGLang nor torch: the factories below import their
modules when called.
"""

from __future__ import annotations

from typing import Any

from loongsage_hookspecs import EngineContext, EngineRouterContext, WeightTransportContext

__version__ = "0.1.0"


def create_server(ctx: EngineContext) -> Any:
    """``factory(ctx: EngineContext) -> SGLangServer`` of the ``sglang`` rollout engine."""
    from .server import SGLangServer

    return SGLangServer(ctx)


def sglang_router(ctx: EngineRouterContext, **args: Any) -> Any:
    """``EngineRouter``: the real sglang-router in front of ``ctx.engine_urls``, sending the
    engines ``ctx.api_key`` (``[rollout] engine_router_args``: ``policy``, ``extra_args``,
    ``startup_timeout_s``, ``log_path``, ``port``)."""
    from .router import SGLangRouterProcess

    return SGLangRouterProcess(list(ctx.engine_urls), **{"api_key": ctx.api_key, **args})


def disk_sender(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightSender`` writing safetensors and calling ``/update_weights_from_disk``."""
    from .transport_disk import DiskSender

    return DiskSender(**args)


def nccl_sender(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightSender`` broadcasting buckets announced with ``/update_weights_from_distributed``."""
    from .transport_nccl import NcclSender

    return NcclSender(**args)


def tensor_sender(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightSender`` passing tensor handles (CUDA IPC / shared memory) to ``/update_weights_from_tensor``."""
    from .transport_tensor import TensorHandleSender

    return TensorHandleSender(**args)


__all__ = ["create_server", "disk_sender", "nccl_sender", "sglang_router", "tensor_sender"]
