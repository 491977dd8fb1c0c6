"""The host-side loss pipeline (DESIGN.md section 6).

Train backends build one :class:`LossPipeline` from the job's ``[algorithm]`` table and call it
per micro-batch; :func:`compute_norm` gives the global denominators of a mini-batch and
:class:`MetricAccumulator` turns per-micro-batch metric contributions into exact mini-batch means.

Importing this package does not import torch; tensor work happens inside the functions.
"""

from __future__ import annotations

from .metrics import MetricAccumulator
from .norm import compute_norm
from .pipeline import CORRECTION_MASK_KEY, CORRECTION_WEIGHTS_KEY, LossPipeline, LossPipelineError

__all__ = [
    "CORRECTION_MASK_KEY",
    "CORRECTION_WEIGHTS_KEY",
    "LossPipeline",
    "LossPipelineError",
    "MetricAccumulator",
    "compute_norm",
]
