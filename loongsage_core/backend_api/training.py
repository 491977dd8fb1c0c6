"""The ``[train]`` learning-rate schedule (warmup, constant / linear / cosine), the same in every backend."""

from __future__ import annotations

from ..lr_schedule import lr_factor, make_scheduler

__all__ = ["lr_factor", "make_scheduler"]
