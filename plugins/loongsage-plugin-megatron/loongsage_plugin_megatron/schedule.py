"""Learning-rate schedule: the host's warmup and decay (as in the torch backend), so both train alike."""

from __future__ import annotations

from typing import Any

from loongsage_core.backend_api.training import make_scheduler


def megatron_optimizers(megatron_optimizer: Any) -> list[Any]:
    """The Megatron optimizers of a Megatron-Core optimizer: ``get_megatron_optimizer`` returns a
    ``ChainedOptimizer`` of one per parameter kind (dense, expert-parallel), or a single one."""
    return list(getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]))


def torch_optimizers(megatron_optimizer: Any) -> list[Any]:
    """The ``torch.optim`` optimizers inside a Megatron-Core optimizer (none on a rank without
    parameters): each Megatron optimizer wraps one in ``.optimizer``."""
    return [inner.optimizer for inner in megatron_optimizers(megatron_optimizer)
            if getattr(inner, "optimizer", None) is not None]


class MegatronScheduler:
    """The ``[train]`` schedule on every torch optimizer of a Megatron-Core optimizer.

    Megatron's own ``OptimizerParamScheduler`` warms up from step 0 at ``init_lr``; the torch
    backend's first step already trains at ``lr / warmup_steps``. Scheduling the inner torch
    optimizers with the torch backend's ``LambdaLR`` keeps both backends' learning rates equal.
    """

    def __init__(self, megatron_optimizer: Any, train: Any) -> None:
        self.schedulers = [make_scheduler(opt, train) for opt in torch_optimizers(megatron_optimizer)]

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["schedulers"]
        if len(saved) != len(self.schedulers):
            raise ValueError(f"learning-rate schedule state: {len(saved)} schedules saved, "
                             f"{len(self.schedulers)} optimizers to schedule")
        for scheduler, item in zip(self.schedulers, saved):
            scheduler.load_state_dict(item)


def make_megatron_scheduler(megatron_optimizer: Any, train: Any) -> MegatronScheduler:
    """A :class:`MegatronScheduler` following the ``[train]`` table's schedule settings."""
    return MegatronScheduler(megatron_optimizer, train)
