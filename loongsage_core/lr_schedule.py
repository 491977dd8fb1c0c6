"""Learning-rate schedules shared by the train backends: constant, linear or cosine decay after a
linear warmup (the same schedule in every backend, so they train alike)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Warmup: step ``k < warmup_steps`` uses ``(k + 1) / warmup_steps`` (the first step already
    trains). Then ``constant`` stays at 1, ``linear`` and ``cosine`` decay from 1 towards
    ``min_lr_ratio`` over the remaining ``total_steps - warmup_steps`` steps.
    """
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"[train] lr_schedule: unknown schedule {schedule!r} (constant, linear, cosine)")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    if schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def make_scheduler(optimizer: "torch.optim.Optimizer", train: Any) -> "torch.optim.lr_scheduler.LambdaLR":
    """A ``LambdaLR`` over ``optimizer`` following the ``[train]`` table's schedule settings."""
    import torch

    if train.lr_warmup_steps < 0:
        raise ValueError(f"[train] lr_warmup_steps must be >= 0, got {train.lr_warmup_steps}")
    if not 0.0 <= train.min_lr_ratio <= 1.0:
        raise ValueError(f"[train] min_lr_ratio must be in [0, 1], got {train.min_lr_ratio}")
    schedule, warmup, total, floor = train.lr_schedule, train.lr_warmup_steps, train.total_steps, train.min_lr_ratio

    def factor(step: int) -> float:
        return lr_factor(step, schedule=schedule, warmup_steps=warmup, total_steps=total, min_lr_ratio=floor)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
