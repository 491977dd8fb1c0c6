"""Typed records that cross hook boundaries.

Every value a component receives from the host, or hands back to it, is one of these attrs
classes. Tensor-valued fields are ``torch.Tensor``; these modules never import torch at import
time (only under ``TYPE_CHECKING`` or inside methods), so plugin packages that do no tensor work
stay light.

Tensor layout conventions (used by every record with per-token tensors):

* ``[B, T]`` rows are right-padded token sequences: ``input_ids[i, t]`` is token ``t`` of row ``i``.
* Per-token values are aligned with the token they describe: ``logprobs[i, t]`` is
  ``log p(input_ids[i, t] | input_ids[i, :t])``; position 0 has no prediction and holds 0.
* ``loss_mask[i, t] == 1`` exactly on tokens the policy generated and that are trained on.

The records live in modules by what they describe; import them from here (or from
``loongsage_hookspecs``), the module a name lives in is not part of the contract:

* :mod:`.trajectory`: a rollout's trajectories, segments, rewards and sampling settings;
* :mod:`.batch`: the training :class:`Batch` and its documented tensor names;
* :mod:`.loss`: what loss-pipeline components and teachers receive and return;
* :mod:`.routing`: the experts a mixture-of-experts engine routed each token to;
* :mod:`.weights`: the metadata of a weight update's buckets;
* :mod:`.agents`: what an agent receives and returns, and a sandbox command's outcome.
"""

from __future__ import annotations

from .agents import AgentContext, AgentResult, ExecResult
from .batch import BATCH_FIELDS, Batch
from .loss import (
    AdvantageInputs,
    AdvantageOutput,
    AggregationNorm,
    CorrectionInputs,
    CorrectionOutput,
    KLInputs,
    PolicyLossInputs,
    PolicyLossOutput,
    TeacherOutputs,
    teacher_inputs,
)
from .routing import RoutedExperts
from .trajectory import (
    AgentFailure,
    FailureClass,
    GrammarSpan,
    Reward,
    SamplingParams,
    Segment,
    SegmentImage,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
)
from .weights import TensorMeta, WeightBucket, WeightTarget

__all__ = [
    "BATCH_FIELDS",
    "AdvantageInputs",
    "AdvantageOutput",
    "AgentContext",
    "AgentFailure",
    "AgentResult",
    "AggregationNorm",
    "Batch",
    "CorrectionInputs",
    "CorrectionOutput",
    "ExecResult",
    "FailureClass",
    "GrammarSpan",
    "KLInputs",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "Reward",
    "RoutedExperts",
    "SamplingParams",
    "Segment",
    "SegmentImage",
    "TeacherOutputs",
    "TensorMeta",
    "Trajectory",
    "TrajectoryGroup",
    "TrajectoryStatus",
    "WeightBucket",
    "WeightTarget",
    "teacher_inputs",
]
