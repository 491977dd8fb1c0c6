"""Records of a rollout: trajectories, their token segments and rewards, and sampling settings.

A :class:`Trajectory` is everything recorded for one sample (prompt, agent conversation, reward);
its :class:`Segment` lists hold the token-exact record that training rows are built from, and the
trajectories sampled for one prompt form a :class:`TrajectoryGroup`. :class:`SamplingParams`
are the sampling settings every rollout engine takes.
"""

from __future__ import annotations

import enum
from typing import Any, Iterable, Sequence

import attrs

from .routing import RoutedExperts


class TrajectoryStatus(str, enum.Enum):
    """Life cycle of a trajectory; only ``completed`` ones are trained on by default."""

    PENDING = "pending"
    GENERATING = "generating"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"


class FailureClass(str, enum.Enum):
    """Whose fault a failed trajectory is, which decides what training makes of it.

    ``agent``: the policy's behaviour failed the task (its conversation outgrew the context, or
    the agent raised :class:`AgentFailure`, e.g. on a tool call it could not recover from): a
    real outcome, trained on with reward 0 like a wrong answer. ``infra``: something around the
    policy broke (a sandbox, an agent CLI that crashed or timed out, an engine, a reward that
    raised, timed out or returned no number): no evidence about the policy, so by default it is
    left out of its group's statistics and of the loss (``[algorithm] infra_failures``).
    """

    AGENT = "agent"
    INFRA = "infra"


class AgentFailure(Exception):
    """Raised by an agent when the policy's own behaviour ended the trajectory (a malformed tool
    call it could not recover from, a turn budget spent on nonsense): the trajectory fails as
    :attr:`FailureClass.AGENT` and is trained on with reward 0. Any other exception an agent
    raises is counted as an infrastructure failure."""


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


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@attrs.define(frozen=True)
class GrammarSpan:
    """Tokens ``[start, end)`` of a segment that were sampled under a grammar (constrained decoding:
    a forced tool call, structured output).

    The engine sampled each of them from the policy's distribution restricted to the tokens the
    grammar allowed at that point, so their log-probs are of that restricted distribution; a
    trainer scores them the same way by replaying the grammar over the tokens (the grammar starts
    at ``start``). ``grammar`` is the grammar in llguidance's serialized form; ``stop_token_ids``
    are the turn's stop tokens, which the grammar allows exactly where it may end (and only there).
    """

    start: int
    end: int
    grammar: str
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"GrammarSpan needs 0 <= start <= end, got start={self.start} end={self.end}")


@attrs.define
class SegmentImage:
    """One image inside a segment: the sha256 of its bytes (a key of :attr:`Trajectory.images`)
    and the span of placeholder tokens that stand for it (``tokens[start:start + length]``, the
    model's image token repeated once per vision embedding). The trainer rebuilds the vision
    inputs from the bytes, so its forward sees what the rollout engine saw."""

    sha256: str
    start: int
    length: int


@attrs.define
class Segment:
    """One contiguous token sequence of a trajectory; each trainable segment is one training row.

    A single-turn trajectory has one segment (prompt tokens then response tokens). A multi-turn
    trajectory grows one segment turn by turn; when an agent edits or compacts its history, or runs
    a sub-agent (a second conversation), so that a request no longer extends a recorded segment, a
    new segment starts, and the segments form a tree that forks where the prompts diverge.

    All lists have the same length. ``logprobs`` holds the rollout engine's log-probability of each
    generated token (0.0 elsewhere); ``weight_versions`` the policy version that produced it (-1 on
    tokens the policy did not generate); ``turns`` holds ``(start, end)`` token spans of each model
    turn. ``routed_experts`` (a mixture-of-experts engine asked for them, ``[algorithm]
    router_replay``) holds the experts the engine routed every token to, one record per token
    (:meth:`record_routes`). ``constraints`` lists the spans sampled under a grammar
    (:class:`GrammarSpan`); the trainer replays them so it scores the distribution the engine
    sampled.

    ``images`` (a conversation with images, on a vision-language model) lists the images of the
    segment in token order with the span of their placeholder tokens (:class:`SegmentImage`);
    those tokens always have loss mask 0.

    ``parent`` and ``fork_at`` place the segment in its trajectory's tree: the segment shares its
    first ``fork_at`` tokens with ``trajectory.segments[parent]`` (``tokens[:fork_at] ==
    parent.tokens[:fork_at]``, the longest such prefix among the earlier segments) and differs
    after them. The shared tokens have loss mask 0 here (the parent trains the ones the model
    generated), so a token is trained in one segment only. A root segment (the first, or one that
    shares no token with any earlier segment) has both ``None``.
    """

    tokens: list[int] = attrs.field(factory=list)
    loss_mask: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    weight_versions: list[int] = attrs.field(factory=list)
    turns: list[tuple[int, int]] = attrs.field(factory=list)
    routed_experts: RoutedExperts | None = None
    parent: int | None = None
    fork_at: int | None = None
    constraints: list[GrammarSpan] = attrs.field(factory=list)
    images: list[SegmentImage] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        if (self.parent is None) != (self.fork_at is None):
            raise ValueError(f"Segment parent and fork_at are set together, got parent={self.parent!r} "
                             f"fork_at={self.fork_at!r}")
        if self.parent is not None and (self.parent < 0 or self.fork_at is None or self.fork_at < 1):
            raise ValueError(f"Segment parent must be >= 0 and fork_at >= 1, got parent={self.parent!r} "
                             f"fork_at={self.fork_at!r}")
        lengths = {len(self.tokens), len(self.loss_mask), len(self.logprobs), len(self.weight_versions)}
        if self.routed_experts is not None:
            lengths.add(len(self.routed_experts))
        if len(lengths) != 1:
            routes = "" if self.routed_experts is None else f" routed_experts={len(self.routed_experts)}"
            raise ValueError(
                "Segment fields must have equal lengths, got "
                f"tokens={len(self.tokens)} loss_mask={len(self.loss_mask)} "
                f"logprobs={len(self.logprobs)} weight_versions={len(self.weight_versions)}{routes}"
            )
        for image in self.images:
            if image.start < 0 or image.length < 1 or image.start + image.length > len(self.tokens):
                raise ValueError(f"Segment image {image.sha256[:12]} spans tokens [{image.start}, "
                                 f"{image.start + image.length}) outside the segment's {len(self.tokens)} tokens")

    def record_routes(self, routes: RoutedExperts | None) -> None:
        """Keep the engine's routing of this segment's tokens: the latest engine call's, whose
        input was the segment so far, so it covers every earlier token and replaces what was
        recorded (a partial rollout's resumed call, the next turn). Tokens it did not run (the
        last generated one) get no record (-1). ``None`` keeps the record, if any, as it is."""
        if routes is not None:
            self.routed_experts = routes.padded(len(self.tokens))

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
        if self.routed_experts is not None:  # the new tokens have no record until the engine gives one
            self.routed_experts.extend_unrecorded(n)  # in place: no copy of the segment's record per turn

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
    saw it. ``segments`` hold the token-exact record used for training. A ``failed`` trajectory
    says whose fault it was in ``failure`` (:class:`FailureClass`; ``None`` when not failed, or
    failed by a host that did not say, which counts as infrastructure).
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
    failure: FailureClass | None = None
    images: dict[str, str] = attrs.field(factory=dict)
    """The images of the conversation, stored once each: sha256 of the bytes -> the bytes in
    base64 (PNG, JPEG, ... as the agent sent them); segments refer to them by hash."""

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
