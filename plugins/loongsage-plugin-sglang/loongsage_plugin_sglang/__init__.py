"""LoongSage plugin: SGLang rollout engine backend: server actors, native HTTP API, weight updates.

Components (see :mod:`.plugin`): the ``sglang`` rollout engine (:mod:`.server`, command line in
:mod:`.launch`), the ``sglang_disk`` (:mod:`.transport_disk`), ``sglang_nccl``
(:mod:`.transport_nccl`) and ``sglang_tensor`` (:mod:`.transport_tensor`) weight transports;
plus SGLang control calls (:mod:`.client`) and sglang-router management (:mod:`.router`).
Importing this package imports neither SGLang nor torch: the factories below import their
modules when called.
"""

from __future__ import annotations

from typing import Any, Mapping

from loongsage_hookspecs import EngineContext, EngineRouterContext, WeightTarget, WeightTransportContext

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


# ``auto_rank`` of this plugin's transports, for SGLang servers (see the ``auto`` transport's table)
TENSOR_RANK = 90
NCCL_RANK = 60
DISK_RANK = 10


def is_sglang_server(info: Mapping[str, Any]) -> bool:
    """Whether a ``/get_server_info`` answer is an SGLang server's: its server arguments
    (``model_path``, ``tp_size``) and no ``weight_load_formats`` (the embedded engine's list)."""
    return "weight_load_formats" not in info and "model_path" in info and "tp_size" in info


def _sglang_target(target: WeightTarget) -> bool:
    """Whether ``target`` is an SGLang server reached over HTTP."""
    return target.url is not None and is_sglang_server(target.server_info)


def tensor_rank(target: WeightTarget) -> int | None:
    """CUDA IPC handles reach an SGLang server on the trainer's own GPU: a colocated run whose
    trainer holds its weights on a GPU (each engine shares its trainer rank's device)."""
    return TENSOR_RANK if _sglang_target(target) and target.colocated and target.trainer_on_gpu else None


def nccl_rank(target: WeightTarget) -> int | None:
    """An NCCL group reaches an SGLang server on any GPU, when the trainer's weights are on one."""
    return NCCL_RANK if _sglang_target(target) and target.trainer_on_gpu else None


def disk_rank(target: WeightTarget) -> int | None:
    """Safetensors on a shared directory reach any SGLang server: the path left when the trainer
    has no GPU (and so no NCCL to the server's)."""
    return DISK_RANK if _sglang_target(target) else None


__all__ = ["create_server", "disk_rank", "disk_sender", "is_sglang_server", "nccl_rank", "nccl_sender",
           "sglang_router", "tensor_rank", "tensor_sender"]
