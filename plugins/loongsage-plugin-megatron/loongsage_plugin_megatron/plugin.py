"""Hook implementations of loongsage-plugin-megatron (the module its entry point names).

Provides the ``megatron`` train backend. Megatron-Core, Megatron-Bridge and torch are imported
only when a worker is built.
"""

from __future__ import annotations

from typing import Any, Iterator

from loongsage_hookspecs import TrainBackendSpec, hookimpl


def create_train_worker(ctx: Any) -> Any:
    """Build one rank of the megatron backend (``ctx`` is a ``TrainWorkerContext``)."""
    from .worker import MegatronTrainWorker

    return MegatronTrainWorker(ctx)


@hookimpl
def loongsage_train_backends() -> Iterator[TrainBackendSpec]:
    yield TrainBackendSpec(name="megatron", factory=create_train_worker,
                           description="Megatron-Core GPT model built by Megatron-Bridge from a Hugging Face "
                                       "directory; tensor, pipeline (1F1B), data (Megatron DDP) and, for "
                                       "Mixture-of-Experts models, expert parallelism; Megatron-Core Adam optimizer")
