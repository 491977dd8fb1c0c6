"""Learning-rate schedule: the same warmup and decay as the torch backend, so both train alike."""

from __future__ import annotations

from typing import Any


def make_scheduler(optimizer: Any, train: Any) -> Any:
    """A ``LambdaLR`` following the ``[train]`` table (shared implementation of loongsage-plugin-torch)."""
    from loongsage_plugin_torch.trainer.schedule import make_scheduler as torch_make_scheduler

    return torch_make_scheduler(optimizer, train)
