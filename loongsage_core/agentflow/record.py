"""What the router records for one trajectory, and its JSON form for the HTTP admin API."""

from __future__ import annotations

import time
from typing import Any

import attrs

from loongsage_hookspecs import Segment, TrajectoryStatus


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
    ``cached_tokens`` how many prompt tokens the engine's prefix cache served (summed over them).
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

    @property
    def response_tokens(self) -> int:
        """Model-generated tokens across all segments (what the response budget counts)."""
        return sum(s.num_generated for s in self.segments)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the admin API's wire format)."""
        out = attrs.asdict(self, recurse=True)
        out["status"] = self.status.value
        for seg in out["segments"]:
            seg["turns"] = [list(t) for t in seg["turns"]]
        for turn in out["turns"]:
            turn["weight_versions"] = list(turn["weight_versions"])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrajectoryRecord":
        """Inverse of :meth:`to_dict`."""
        data = dict(data)
        data["status"] = TrajectoryStatus(data.get("status", "pending"))
        data["segments"] = [Segment(tokens=s["tokens"], loss_mask=s["loss_mask"], logprobs=s["logprobs"],
                                    weight_versions=s["weight_versions"], turns=[tuple(t) for t in s["turns"]])
                            for s in data.get("segments", [])]
        data["turns"] = [TurnInfo(**{**t, "weight_versions": tuple(t["weight_versions"])})
                         for t in data.get("turns", [])]
        return cls(**data)
