"""Hook implementations of loongsage-plugin-torch (the module its entry point names).

Provides the ``torch`` train backend, the ``torch`` rollout engine and the ``inprocess``,
``shm``, ``broadcast`` and ``auto`` weight transports. Only the factories are referenced here;
torch and transformers are imported when a component is built.
"""

from __future__ import annotations

from typing import Iterator

from loongsage_hookspecs import (
    Closeable,
    LoadsWeights,
    Offloadable,
    OnDevice,
    ReusesTrainingLogprobs,
    RolloutEngineSpec,
    SharesPrompts,
    StepwiseTraining,
    TrainBackendSpec,
    WeightTransportSpec,
    hookimpl,
)

from .engine import check_engine_args, create_engine
from .trainer import create_train_worker
from .trainer.backend_options import check_job
from .transport import (
    auto_sender,
    broadcast_rank,
    broadcast_receiver,
    broadcast_sender,
    inprocess_rank,
    inprocess_receiver,
    inprocess_sender,
    shm_rank,
    shm_receiver,
    shm_sender,
)


@hookimpl
def loongsage_train_backends() -> Iterator[TrainBackendSpec]:
    yield TrainBackendSpec(name="torch", factory=create_train_worker,
                           description="embedded PyTorch trainer (transformers models, AdamW, DP over "
                                       "torch.distributed; LoRA through PEFT)", supports_lora=True,
                           check_job=check_job,
                           capabilities=(Offloadable, OnDevice, ReusesTrainingLogprobs, SharesPrompts, LoadsWeights,
                                         Closeable, StepwiseTraining))


@hookimpl
def loongsage_rollout_engines() -> Iterator[RolloutEngineSpec]:
    yield RolloutEngineSpec(name="torch", factory=create_engine,
                            description="embedded engine: continuous batching, KV cache, SGLang-native HTTP API",
                            supports_lora=True, check_job=check_engine_args)


@hookimpl
def loongsage_weight_transports() -> Iterator[WeightTransportSpec]:
    yield WeightTransportSpec(name="inprocess", sender=inprocess_sender,
                              args_from="loongsage_plugin_torch.transport.inprocess:InProcessSender",
                              receiver=inprocess_receiver,
                              colocated_only=True, auto_rank=inprocess_rank,
                              description="trainer and engine in one process: tensors handed over directly")
    yield WeightTransportSpec(name="shm", sender=shm_sender,
                              args_from="loongsage_plugin_torch.transport.shm:ShmSender",
                              receiver=shm_receiver, auto_rank=shm_rank,
                              description="bucketed shared memory between processes on one node")
    yield WeightTransportSpec(name="broadcast", sender=broadcast_sender,
                              args_from="loongsage_plugin_torch.transport.broadcast:BroadcastSender",
                              receiver=broadcast_receiver,
                              auto_rank=broadcast_rank,
                              description="bucketed broadcast over a torch.distributed group (Gloo on CPU, "
                                          "NCCL on GPU) to engines on other devices or nodes")
    yield WeightTransportSpec(name="auto", sender=auto_sender, args_per_transport=True,
                              description="per engine the fastest transport that reaches it (each active "
                                          "transport's auto_rank): inprocess, shm on one node, broadcast across "
                                          "devices and nodes, the sglang plugin's for SGLang servers")
