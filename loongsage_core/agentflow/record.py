"""What the router records for one trajectory, and its JSON form for the HTTP admin API."""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

import attrs

from loongsage_hookspecs import GrammarSpan, RoutedExperts, Segment, SegmentImage, TrajectoryStatus

SEED_RANGE = (-(2**63), 2**63 - 1)
"""Seeds the router accepts (a signed 64-bit integer, what engines can seed a generator with)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def check_sampling(values: Mapping[str, Any]) -> None:
    """Refuse sampling settings an engine would reject, naming the key (``ValueError``).

    Checked at registration so a bad trajectory fails there, not on its agent's first request.
    Keys not listed here are passed to the engine unchanged.
    """
    def fail(key: str, rule: str) -> None:
        raise ValueError(f"sampling.{key} must be {rule}, got {values[key]!r}")

    def number(key: str, lo: float, hi: float, lo_open: bool = False) -> None:
        v = values.get(key)
        if v is None:
            return
        if not _is_number(v) or v < lo or v > hi or (lo_open and v == lo):
            fail(key, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")

    number("temperature", 0.0, 1e6)
    number("top_p", 0.0, 1.0, lo_open=True)
    number("min_p", 0.0, 1.0)
    number("repetition_penalty", 0.0, 1e6, lo_open=True)
    number("presence_penalty", -2.0, 2.0)
    number("frequency_penalty", -2.0, 2.0)
    top_k = values.get("top_k")
    if top_k is not None and (not _is_int(top_k) or (top_k != -1 and top_k < 1)):
        fail("top_k", "-1 (disabled) or an integer >= 1")
    for key in ("max_new_tokens", "max_tokens"):
        v = values.get(key)
        if v is not None and (not _is_int(v) or v < 1):
            fail(key, "an integer >= 1")
    for key in ("seed", "sampling_seed"):
        v = values.get(key)
        if v is not None and (not _is_int(v) or not SEED_RANGE[0] <= v <= SEED_RANGE[1]):
            fail(key, "a 64-bit signed integer")
    stops = values.get("stop_token_ids")
    if stops is not None and (not isinstance(stops, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in stops)):
        fail("stop_token_ids", "a list of token ids (non-negative integers)")
    locked = values.get("locked")
    if locked is not None and not isinstance(locked, bool):
        fail("locked", "a boolean")


@attrs.define
class SamplingDefaults:
    """Sampling settings the host registers for a trajectory (SGLang names).

    A request's own values (``temperature``, ``top_p``, ``max_tokens``, ...) override these
    unless ``locked`` is set, in which case the host's values always win (useful when the policy
    must be sampled at the training temperature whatever the agent asks for).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    seed: int | None = None
    stop_token_ids: list[int] = attrs.field(factory=list)
    extra: dict[str, Any] = attrs.field(factory=dict)
    locked: bool = False

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "SamplingDefaults":
        """Build from a mapping; unknown keys go to ``extra`` (passed through to the engine)."""
        values = dict(values or {})
        if "sampling_seed" in values and "seed" not in values:
            values["seed"] = values.pop("sampling_seed")
        if "max_tokens" in values and "max_new_tokens" not in values:
            values["max_new_tokens"] = values.pop("max_tokens")
        names = {f.name for f in attrs.fields(cls)} - {"extra"}
        known = {k: v for k, v in values.items() if k in names}
        extra = {k: v for k, v in values.items() if k not in names}
        return cls(**known, extra=extra)


@attrs.define
class TurnInfo:
    """One chat-completion call of a trajectory.

    ``prompt_tokens`` is the context length sent to the engine, ``new_prompt_tokens`` how many of
    those were appended by this request (mask 0), ``completion_tokens`` the generated ones.
    ``weight_versions`` are the first and last policy versions among the generated tokens;
    ``continuations`` counts engine aborts (weight updates) the turn was resumed across;
    ``cached_tokens`` how many prompt tokens the engine's prefix cache served (summed over them);
    ``speculative`` a speculative-decoding engine's counters (verify forwards, drafted, accepted and
    emitted tokens), ``None`` from an engine that reports none.
    ``new_segment`` says the turn started segment ``segment`` (the request continued no recorded
    segment), and ``segment_reason`` why (e.g. ``"request does not repeat the recorded
    conversation"``); the segment's ``parent`` and ``fork_at`` say where it forked.
    """

    segment: int
    prompt_tokens: int
    new_prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    weight_versions: tuple[int, int] = (-1, -1)
    engine: str = ""
    latency_s: float = 0.0
    continuations: int = 0
    new_segment: bool = False
    cached_tokens: int = 0
    segment_reason: str = ""
    speculative: dict[str, int] | None = None


@attrs.define
class TrajectoryRecord:
    """Everything the router recorded for one trajectory (see :class:`loongsage_hookspecs.Trajectory`).

    ``segments`` are the token-exact training rows; ``messages`` the last conversation the agent
    sent plus the router's final answer; ``turns`` one :class:`TurnInfo` per call.
    """

    trajectory_id: str
    attempt: int = 0
    status: TrajectoryStatus = TrajectoryStatus.PENDING
    segments: list[Segment] = attrs.field(factory=list)
    messages: list[dict[str, Any]] = attrs.field(factory=list)
    turns: list[TurnInfo] = attrs.field(factory=list)
    finish_reason: str | None = None
    error: str | None = None
    max_response_tokens: int | None = None
    max_context_length: int | None = None
    metadata: dict[str, Any] = attrs.field(factory=dict)
    created_at: float = attrs.field(factory=time.time)
    images: dict[str, str] = attrs.field(factory=dict)
    """The conversation's images, once each: sha256 -> base64 bytes (segments refer to them by hash)."""

    @property
    def response_tokens(self) -> int:
        """Model-generated tokens across all segments (what the response budget counts)."""
        return sum(s.num_generated for s in self.segments)

    def tree(self) -> list[dict[str, Any]]:
        """The trajectory's segment tree, one entry per segment: ``parent`` and ``fork_at`` (see
        :class:`~loongsage_hookspecs.Segment`), ``turns`` (the indices of its turns among all
        the trajectory's turns, in the order they were made) and ``reason`` (why it started)."""
        turns: list[list[int]] = [[] for _ in self.segments]
        reasons = [""] * len(self.segments)
        for k, turn in enumerate(self.turns):
            if 0 <= turn.segment < len(turns):
                turns[turn.segment].append(k)
                if turn.new_segment:
                    reasons[turn.segment] = turn.segment_reason
        return [{"segment": i, "parent": s.parent, "fork_at": s.fork_at, "turns": turns[i], "reason": reasons[i]}
                for i, s in enumerate(self.segments)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the admin API's wire format)."""
        out = attrs.asdict(self, recurse=True)
        out["status"] = self.status.value
        for seg, own in zip(out["segments"], self.segments):
            seg["turns"] = [list(t) for t in seg["turns"]]
            seg["routed_experts"] = None if own.routed_experts is None else own.routed_experts.to_json()
        for turn in out["turns"]:
            turn["weight_versions"] = list(turn["weight_versions"])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrajectoryRecord":
        """Inverse of :meth:`to_dict`."""
        data = dict(data)
        data["status"] = TrajectoryStatus(data.get("status", "pending"))
        data["segments"] = [Segment(tokens=s["tokens"], loss_mask=s["loss_mask"], logprobs=s["logprobs"],
                                    weight_versions=s["weight_versions"], turns=[tuple(t) for t in s["turns"]],
                                    routed_experts=(None if s.get("routed_experts") is None
                                                    else RoutedExperts.from_json(s["routed_experts"])),
                                    parent=s.get("parent"), fork_at=s.get("fork_at"),
                                    constraints=[GrammarSpan(**c) for c in s.get("constraints", [])],
                                    images=[SegmentImage(**i) for i in s.get("images", [])])
                            for s in data.get("segments", [])]
        data["turns"] = [TurnInfo(**{**t, "weight_versions": tuple(t["weight_versions"])})
                         for t in data.get("turns", [])]
        return cls(**data)
