"""Hook implementations of loongsage-plugin-sglang (the module its entry point names).

Provides the ``sglang`` rollout engine, the ``sglang_router`` engine router and the
``sglang_disk``, ``sglang_nccl`` and ``sglang_tensor`` weight transports. Only the factories are
referenced here; httpx, torch and the subprocess machinery are imported when a component is
built, and SGLang itself only runs in the server subprocess.
"""

from __future__ import annotations

from typing import Iterator

from loongsage_hookspecs import (
    Closeable,
    EngineRouterSpec,
    LoraAwareSender,
    ReplaceableEngines,
    RolloutEngineSpec,
    WeightTransportSpec,
    hookimpl,
)

from . import (
    create_server,
    disk_rank,
    disk_sender,
    nccl_rank,
    nccl_sender,
    sglang_router,
    tensor_rank,
    tensor_sender,
)

_SENDER = (LoraAwareSender, Closeable)  # what every SGLang sender also does


@hookimpl
def loongsage_rollout_engines() -> Iterator[RolloutEngineSpec]:
    yield RolloutEngineSpec(name="sglang", factory=create_server,
                            description="SGLang server subprocess per engine (python -m sglang.launch_server; "
                                        "[rollout] engine_args pass through as flags); needs a GPU",
                            supports_lora=True)


@hookimpl
def loongsage_weight_transports() -> Iterator[WeightTransportSpec]:
    # received by the engine's own endpoints (SGLang's, or the embedded engine's copies of them)
    yield WeightTransportSpec(name="sglang_disk", sender=disk_sender,
                              args_from="loongsage_plugin_sglang.transport_disk:DiskSender",
                              receiver=None, capabilities=_SENDER,
                              auto_rank=disk_rank,
                              description="safetensors to a shared directory, then SGLang /update_weights_from_disk")
    yield WeightTransportSpec(name="sglang_nccl", sender=nccl_sender,
                              args_from="loongsage_plugin_sglang.transport_nccl:NcclSender",
                              receiver=None, capabilities=_SENDER,
                              auto_rank=nccl_rank,
                              description="NCCL broadcast in buckets announced by SGLang "
                                          "/update_weights_from_distributed")
    yield WeightTransportSpec(name="sglang_tensor", sender=tensor_sender,
                              args_from="loongsage_plugin_sglang.transport_tensor:TensorHandleSender",
                              receiver=None, capabilities=_SENDER,
                              auto_rank=tensor_rank,
                              description="tensor handles (CUDA IPC on GPU, shared memory on CPU) to "
                                          "/update_weights_from_tensor; for engines on the trainer's device")


@hookimpl
def loongsage_engine_routers() -> Iterator[EngineRouterSpec]:
    yield EngineRouterSpec(name="sglang_router", factory=sglang_router,
                           description="sglang-router (cache-aware load balancing) in front of the engines; "
                                       "runs on CPU", capabilities=(ReplaceableEngines,))
