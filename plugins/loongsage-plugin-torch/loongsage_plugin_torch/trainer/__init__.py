"""The embedded PyTorch train backend (``[train] backend = "torch"``).

Importing this package is cheap: torch and transformers are imported when a worker is built.
The plugin registers :func:`create_train_worker` as the backend's factory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loongsage_hookspecs import TrainWorkerContext

if TYPE_CHECKING:  # pragma: no cover
    from .critic import TorchCriticWorker
    from .worker import TorchTrainWorker


def create_train_worker(ctx: TrainWorkerContext) -> "TorchTrainWorker":
    """Build one data-parallel rank (``ctx`` is a ``TrainWorkerContext``) of the torch backend:
    a :class:`TorchTrainWorker` for roles ``actor`` / ``reference``, a value model
    (:class:`~.critic.TorchCriticWorker`) for role ``critic``."""
    if ctx.role == "critic":
        from .critic import TorchCriticWorker

        return TorchCriticWorker(ctx)
    from .worker import TorchTrainWorker

    return TorchTrainWorker(ctx)


def __getattr__(name: str) -> Any:
    if name == "TorchTrainWorker":
        from .worker import TorchTrainWorker

        return TorchTrainWorker
    if name == "TorchCriticWorker":
        from .critic import TorchCriticWorker

        return TorchCriticWorker
    raise AttributeError(name)


__all__ = ["TorchCriticWorker", "TorchTrainWorker", "create_train_worker"]
