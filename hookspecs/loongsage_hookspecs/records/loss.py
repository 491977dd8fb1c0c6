"""Records of the loss pipeline: what its components receive and return.

Advantage estimators, policy losses, KL estimators, loss aggregations and off-policy corrections
each get an ``*Inputs`` record and return an ``*Output`` (or a tensor); teachers return
:class:`TeacherOutputs` for the batch :func:`teacher_inputs` checks. Per-token tensors are
``[B, T]`` with the layout conventions of :mod:`loongsage_hookspecs.records`. This module never
imports torch at import time (only under ``TYPE_CHECKING`` or inside functions).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from .batch import Batch

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


@attrs.define
class AdvantageInputs:
    """What an advantage estimator receives (one mini-batch or the whole step's rows).

    ``rewards`` ``[B]`` are sequence scores (the trajectory's score, equal on all its rows);
    ``token_rewards`` ``[B, T]`` is set when per-token rewards exist besides the score (a KL or
    distillation penalty folded into the reward): token-level estimators add them on their tokens,
    sequence-level ones add their sum over the trajectory to its score. ``group_index`` ``[B]``
    groups rows of the same prompt; ``sample_index`` ``[B]`` (when set) groups the rows (segments)
    of one trajectory, so group statistics count each trajectory once however many segments it
    has, and token-level estimators run one episode over its segments, which appear in segment
    order (``None``: every row is its own trajectory). ``values`` ``[B, T]`` are critic values when
    a critic is trained.
    """

    rewards: "torch.Tensor"
    response_mask: "torch.Tensor"
    group_index: "torch.Tensor"
    token_rewards: "torch.Tensor | None" = None
    values: "torch.Tensor | None" = None
    sample_index: "torch.Tensor | None" = None


@attrs.define
class AdvantageOutput:
    """Per-token advantages ``[B, T]`` (0 where the mask is 0) and, for critics, returns."""

    advantages: "torch.Tensor"
    returns: "torch.Tensor | None" = None


@attrs.define
class PolicyLossInputs:
    """What a policy loss receives; all tensors ``[B, T]`` and aligned with the tokens.

    ``weights`` are the importance-sampling / masking weights computed by the corrections that ran
    before the loss; the host multiplies them in after the loss, so a loss may ignore them.
    """

    logprobs: "torch.Tensor"
    old_logprobs: "torch.Tensor"
    advantages: "torch.Tensor"
    response_mask: "torch.Tensor"
    rollout_logprobs: "torch.Tensor | None" = None
    weights: "torch.Tensor | None" = None


@attrs.define
class PolicyLossOutput:
    """Per-token loss ``[B, T]`` (never aggregated) and per-token metric values.

    Each metric tensor is ``[B, T]``; the host reports its masked token mean over the mini-batch
    under ``train/<name>`` (e.g. ``clip_ratio`` as 0/1 indicators).
    """

    loss: "torch.Tensor"
    metrics: dict[str, "torch.Tensor"] = attrs.field(factory=dict)


@attrs.define
class KLInputs:
    """What a KL estimator receives. ``logprobs`` / ``ref_logprobs`` are ``[B, T]`` log-probs of
    the sampled tokens; the ``*_topk_*`` and ``*_logits`` fields are filled when the spec asks
    for them (``KLSpec.requires``), for distillation-style KLs over the vocabulary."""

    logprobs: "torch.Tensor"
    ref_logprobs: "torch.Tensor"
    response_mask: "torch.Tensor"
    logits: "torch.Tensor | None" = None
    ref_topk_ids: "torch.Tensor | None" = None
    ref_topk_logprobs: "torch.Tensor | None" = None
    ref_logits: "torch.Tensor | None" = None


@attrs.define(frozen=True)
class AggregationNorm:
    """Global denominators of one mini-batch (over all micro-batches and data-parallel ranks).

    Aggregations divide by these, not by micro-batch statistics, so a mini-batch's loss and
    gradient do not depend on how it is split.
    """

    num_tokens: float
    num_sequences: float
    max_response_length: float


@attrs.define
class CorrectionInputs:
    """What an off-policy correction receives; all tensors ``[B, T]``.

    ``old_logprobs`` are the trainer's log-probs before the update, ``rollout_logprobs`` the
    engine's. ``logprobs`` (current policy) is set for corrections that run after the forward pass.
    """

    old_logprobs: "torch.Tensor"
    rollout_logprobs: "torch.Tensor"
    response_mask: "torch.Tensor"
    advantages: "torch.Tensor | None" = None
    logprobs: "torch.Tensor | None" = None


@attrs.define
class CorrectionOutput:
    """Multiplicative per-token ``weights`` (IS ratios) and/or a 0/1 ``mask`` ``[B, T]``, plus
    metrics reported as ``train/<name>`` (scalars or per-token tensors averaged on the mask)."""

    weights: "torch.Tensor | None" = None
    mask: "torch.Tensor | None" = None
    metrics: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class TeacherOutputs:
    """A teacher's forward pass over the student's samples, aligned with the tokens ``[B, T]``."""

    logprobs: "torch.Tensor"
    topk_ids: "torch.Tensor | None" = None
    topk_logprobs: "torch.Tensor | None" = None
    logits: "torch.Tensor | None" = None


def teacher_inputs(batch: "Batch", topk: Any, who: str) -> tuple["torch.Tensor", "torch.Tensor"]:
    """``(input_ids, attention_mask)`` of a batch a teacher is asked to score, checked the same way
    by every teacher backend (``who`` names it in the errors): ``input_ids`` ``[B, T]``, an
    ``attention_mask`` of that shape (all ones when absent), ``topk`` an integer >= 0."""
    import torch

    ids = batch.get("input_ids")
    if ids is None:
        raise KeyError(f"{who}: the batch has no 'input_ids' tensor")
    if ids.dim() != 2:
        raise ValueError(f"{who}: input_ids must be [B, T], got shape {tuple(ids.shape)}")
    attention = batch.get("attention_mask")
    if attention is None:
        attention = torch.ones_like(ids)
    if tuple(attention.shape) != tuple(ids.shape):
        raise ValueError(f"{who}: attention_mask {tuple(attention.shape)} and input_ids "
                         f"{tuple(ids.shape)} differ in shape")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
        raise ValueError(f"{who}: topk must be an integer >= 0, got {topk!r}")
    return ids, attention
