"""The ``[algorithm]`` loss as backends compute it, per micro-batch, and its metrics."""

from __future__ import annotations

from ..algorithms import LossPipeline, LossPipelineError, MetricAccumulator, compute_norm
from ..algorithms.old_logprobs import old_from_training_forward

__all__ = ["LossPipeline", "LossPipelineError", "MetricAccumulator", "compute_norm", "old_from_training_forward"]
