"""Typed records that cross hook boundaries.

Every value a component receives from the host, or hands back to it, is one of these attrs
classes. Tensor-valued fields are ``torch.Tensor``; this module never imports torch at import
time (only under ``TYPE_CHECKING`` or inside methods), so plugin packages that do no tensor work
stay light.

Tensor layout conventions (used by every record with per-token tensors):

* ``[B, T]`` rows are right-padded token sequences: ``input_ids[i, t]`` is token ``t`` of row ``i``.
* Per-token values are aligned with the token they describe: ``logprobs[i, t]`` is
  ``log p(input_ids[i, t] | input_ids[i, :t])``; position 0 has no prediction and holds 0.
* ``loss_mask[i, t] == 1`` exactly on tokens the policy generated and that are trained on.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import attrs

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


class TrajectoryStatus(str, enum.Enum):
    """Life cycle of a trajectory; only ``completed`` ones are trained on by default."""

    PENDING = "pending"
    GENERATING = "generating"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"


@attrs.define
class Reward:
    """The outcome a reward function assigns to one trajectory.

    ``score`` is what the advantage estimator sees; ``details`` are extra named numbers that are
    logged per data source (``rollout_per_source/<name>/reward/<key>``); ``error`` is set when the
    reward function raised, in which case ``score`` is 0 and the trajectory is marked failed.
    ``reason`` says in words why the score is what it is (shown in rollout records and the run
    viewer). When a data source lists several rewards, the host sums them and keeps each one's
    own outcome in ``components`` (reward name -> :class:`Reward`).
    """

    score: float
    details: dict[str, float] = attrs.field(factory=dict)
    error: str | None = None
    reason: str = ""
    components: dict[str, "Reward"] = attrs.field(factory=dict)


@attrs.define
class Segment:
    """One contiguous token sequence of a trajectory; each trainable segment is one training row.

    A single-turn trajectory has one segment (prompt tokens then response tokens). A multi-turn
    trajectory grows one segment turn by turn; when an agent edits or compacts its history, so that
    a request no longer extends the recorded tokens, a new segment starts.

    All lists have the same length. ``logprobs`` holds the rollout engine's log-probability of each
    generated token (0.0 elsewhere); ``weight_versions`` the policy version that produced it (-1 on
    tokens the policy did not generate); ``turns`` holds ``(start, end)`` token spans of each model
    turn.
    """

    tokens: list[int] = attrs.field(factory=list)
    loss_mask: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    weight_versions: list[int] = attrs.field(factory=list)
    turns: list[tuple[int, int]] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        lengths = {len(self.tokens), len(self.loss_mask), len(self.logprobs), len(self.weight_versions)}
        if len(lengths) != 1:
            raise ValueError(
                "Segment fields must have equal lengths, got "
                f"tokens={len(self.tokens)} loss_mask={len(self.loss_mask)} "
                f"logprobs={len(self.logprobs)} weight_versions={len(self.weight_versions)}"
            )

    def append(self, tokens: Sequence[int], *, generated: bool, logprobs: Sequence[float] | None = None,
               weight_version: int | Sequence[int] = -1) -> None:
        """Append tokens: generated ones get mask 1 and their logprobs, the others mask 0."""
        n = len(tokens)
        if generated:
            if logprobs is None or len(logprobs) != n:
                raise ValueError("generated tokens need one logprob each")
            start = len(self.tokens)
            self.turns.append((start, start + n))
        self.tokens.extend(int(t) for t in tokens)
        self.loss_mask.extend([1 if generated else 0] * n)
        if generated and logprobs is not None:
            self.logprobs.extend(float(x) for x in logprobs)
        else:
            self.logprobs.extend([0.0] * n)
        if isinstance(weight_version, int):
            self.weight_versions.extend([weight_version if generated else -1] * n)
        else:
            if len(weight_version) != n:
                raise ValueError("weight_version sequence must match tokens")
            self.weight_versions.extend(int(v) for v in weight_version)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def trainable(self) -> bool:
        return self.num_generated > 0


@attrs.define
class Trajectory:
    """Everything recorded for one sample: one prompt, one agent run, one reward.

    ``prompt`` is what the data source gave (a string or a list of chat messages), ``label`` the
    reference answer (any JSON value), ``metadata`` the rest of the data row. ``response_text`` is
    the final model answer as text (for rewards), ``messages`` the full conversation as the agent
    saw it. ``segments`` hold the token-exact record used for training.
    """

    id: str
    prompt_id: str
    group_id: str
    source: str = "default"
    prompt: Any = None
    label: Any = None
    metadata: dict[str, Any] = attrs.field(factory=dict)
    segments: list[Segment] = attrs.field(factory=list)
    response_text: str = ""
    messages: list[dict[str, Any]] = attrs.field(factory=list)
    status: TrajectoryStatus = TrajectoryStatus.PENDING
    finish_reason: str | None = None
    reward: Reward | None = None
    error: str | None = None

    @property
    def response_length(self) -> int:
        """Number of policy-generated tokens across all segments."""
        return sum(s.num_generated for s in self.segments)

    @property
    def score(self) -> float:
        return self.reward.score if self.reward is not None else 0.0


@attrs.define
class TrajectoryGroup:
    """The N trajectories sampled for one prompt; group-relative estimators work per group."""

    group_id: str
    prompt_id: str
    source: str = "default"
    trajectories: list[Trajectory] = attrs.field(factory=list)

    @property
    def scores(self) -> list[float]:
        return [t.score for t in self.trajectories]

    def __len__(self) -> int:
        return len(self.trajectories)


@attrs.define
class SamplingParams:
    """Sampling settings, named as SGLang's ``sampling_params`` (so one client drives every engine)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = attrs.field(factory=list)
    seed: int | None = None

    def to_sglang(self) -> dict[str, Any]:
        """The dict sent as ``sampling_params`` in a ``/generate`` request."""
        out = attrs.asdict(self)
        if out["seed"] is None:
            del out["seed"]
        out["sampling_seed"] = self.seed
        return {k: v for k, v in out.items() if v is not None}


# --------------------------------------------------------------------------------------------
# Tensor records (the loss pipeline)
# --------------------------------------------------------------------------------------------

BATCH_FIELDS: Mapping[str, str] = {
    "input_ids": "[B, T] long token ids, right-padded",
    "attention_mask": "[B, T] 1 on real tokens, 0 on padding",
    "position_ids": "[B, T] long, optional: packed rows, positions restart at 0 for each sequence in a row "
                    "(attention stays within each sequence)",
    "loss_mask": "[B, T] 1 on trained (policy-generated) tokens",
    "rollout_logprobs": "[B, T] engine log-probs of the sampled tokens",
    "old_logprobs": "[B, T] trainer log-probs before the update (recomputed or = rollout)",
    "ref_logprobs": "[B, T] frozen reference model log-probs",
    "advantages": "[B, T] per-token advantages",
    "returns": "[B, T] value targets (critic)",
    "values": "[B, T] critic values at rollout time",
    "rewards": "[B] sequence scores",
    "group_index": "[B] long, rows with the same index were sampled for the same prompt",
    "sample_index": "[B] long, rows with the same index are segments of the same trajectory",
    "correction_weights": "[B, T] product of the pre-advantage corrections' IS weights",
    "correction_mask": "[B, T] product of the pre-advantage corrections' masks",
    "weight_versions": "[B, T] long, policy version that produced each token (-1: not generated)",
}
"""Documented tensor names of :class:`Batch`; components may add their own keys."""


@attrs.define
class Batch:
    """A training batch: named tensors with a common leading dimension plus per-row metadata.

    ``tensors`` uses the names of :data:`BATCH_FIELDS`; ``meta`` holds per-row Python values
    (``sample_id``, ``source``, ...), each a list of length ``len(batch)``.
    """

    tensors: dict[str, "torch.Tensor"] = attrs.field(factory=dict)
    meta: dict[str, list[Any]] = attrs.field(factory=dict)

    def __len__(self) -> int:
        for t in self.tensors.values():
            return int(t.shape[0])
        for v in self.meta.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> "torch.Tensor":
        return self.tensors[key]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def get(self, key: str) -> "torch.Tensor | None":
        return self.tensors.get(key)

    def select(self, index: Sequence[int]) -> "Batch":
        """Rows ``index`` of every tensor and meta list, in that order."""
        import torch

        idx = torch.as_tensor(list(index), dtype=torch.long)
        return Batch(
            tensors={k: v.index_select(0, idx.to(v.device)) for k, v in self.tensors.items()},
            meta={k: [v[i] for i in index] for k, v in self.meta.items()},
        )

    def chunks(self, size: int) -> Iterator["Batch"]:
        """Consecutive row chunks of at most ``size`` rows (the last may be smaller)."""
        n = len(self)
        for start in range(0, n, size):
            yield self.select(range(start, min(start + size, n)))

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of ``batches`` one after another; tensors are right-padded to a common length."""
        import torch

        if not batches:
            return Batch()
        keys = batches[0].tensors.keys()
        tensors: dict[str, torch.Tensor] = {}
        for k in keys:
            parts = [b.tensors[k] for b in batches]
            if parts[0].dim() >= 2:
                width = max(p.shape[1] for p in parts)
                parts = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
            tensors[k] = torch.cat(parts, 0)
        meta = {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta}
        return Batch(tensors=tensors, meta=meta)


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


@attrs.define
class TensorMeta:
    """Where one tensor lies inside a weight bucket's flat byte buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@attrs.define
class WeightBucket:
    """Metadata of one bucket of a weight update; sent before the payload it describes."""

    version: int
    index: int
    tensors: list[TensorMeta] = attrs.field(factory=list)
    last: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


# --------------------------------------------------------------------------------------------
# Agents and sandboxes
# --------------------------------------------------------------------------------------------


@attrs.define
class ExecResult:
    """Outcome of one sandbox command."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False


@attrs.define
class AgentContext:
    """What an agent receives for one trajectory.

    ``base_url`` is the trajectory's OpenAI-compatible endpoint (``.../{trajectory_id}/{attempt}/v1``)
    and ``api_key`` the key to send; the agent talks plain chat completions to it. ``sandbox`` is
    the sandbox the framework created for this trajectory (or ``None``); the framework destroys it
    after the agent returns or raises.
    """

    trajectory_id: str
    base_url: str
    api_key: str
    prompt: Any
    label: Any = None
    metadata: dict[str, Any] = attrs.field(factory=dict)
    sampling: dict[str, Any] = attrs.field(factory=dict)
    sandbox: Any = None
    timeout_s: float | None = None


@attrs.define
class AgentResult:
    """What an agent returns: its final answer text and conversation, for the reward."""

    response_text: str = ""
    messages: list[dict[str, Any]] = attrs.field(factory=list)
    metadata: dict[str, Any] = attrs.field(factory=dict)
