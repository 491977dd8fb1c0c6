"""The host-side loss pipeline (docs/guide/algorithms.md).

The controller runs :class:`StepAlgorithm` once per step on all of its rows (pre-advantage
corrections, token rewards, advantages and returns, mini-batches with their global aggregation
denominators, the train-inference gap); train backends build one :class:`LossPipeline` from the
job's ``[algorithm]`` table and call it per micro-batch; :func:`compute_norm` gives the global
denominators of a mini-batch and :class:`MetricAccumulator` turns per-micro-batch metric
contributions into exact mini-batch means.

Importing this package does not import torch; tensor work happens inside the functions.
"""

from __future__ import annotations

from .metrics import MetricAccumulator
from .norm import compute_norm
from .pipeline import CORRECTION_MASK_KEY, CORRECTION_WEIGHTS_KEY, LossPipeline, LossPipelineError
from .step import (
    ROUTER_REPLAY_OUTPUTS,
    StepAlgorithm,
    advantage_metrics,
    router_replay_metrics,
    train_inference_gap,
)

__all__ = [
    "CORRECTION_MASK_KEY",
    "CORRECTION_WEIGHTS_KEY",
    "LossPipeline",
    "LossPipelineError",
    "MetricAccumulator",
    "StepAlgorithm",
    "advantage_metrics",
    "compute_norm",
    "train_inference_gap",
    "ROUTER_REPLAY_OUTPUTS",
    "router_replay_metrics",
]
