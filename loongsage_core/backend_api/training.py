"""What every train backend shares about its optimizer step: the ``[train]`` learning-rate
schedule (warmup, constant / linear / cosine) and the per-step hyperparameters a caller driving
steps in parts may give."""

from __future__ import annotations

from ..lr_schedule import lr_factor, make_scheduler
from ..step_hyperparameters import STEP_HYPERPARAMETERS, apply_step_hyperparameters

__all__ = ["STEP_HYPERPARAMETERS", "apply_step_hyperparameters", "lr_factor", "make_scheduler"]
