"""The router's trajectory registry: which trajectories are live, their records, keys and aborts.

A trajectory is registered under an id and an attempt (a retry registers ``attempt + 1``, which
aborts and replaces the old one); it is found again by the id and attempt of a request's URL
(``/{trajectory_id}/{attempt}/...``), read (:meth:`TrajectoryRegistry.snapshot`), aborted and
finally popped with its record. The registry is plain state: the router touches it from its own
event loop only, so none of it needs a lock.

Every attempt has an API key of its own, derived from the run secret
(:func:`loongsage_core.security.trajectory_key`), which opens that attempt's endpoints and nothing
else.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Mapping

import attrs

from loongsage_hookspecs import SamplingParams, TrajectoryStatus

from ..security import token_matches
from ..security import trajectory_key as derive_trajectory_key
from .conversation import ConversationTracker
from .errors import not_found
from .record import SamplingDefaults, TrajectoryRecord, check_sampling
from .tito import ChatRenderer

AbortAtEngine = Callable[[str, str], None]
"""``abort_at_engine(engine_url, rid)``: ask an engine to stop a request (without waiting)."""


def check_trajectory_id(trajectory_id: Any) -> str:
    """A trajectory id must be a non-empty string usable as one URL path segment."""
    if not isinstance(trajectory_id, str) or not trajectory_id or "/" in trajectory_id or trajectory_id in (".", ".."):
        raise ValueError(f"trajectory id must be a non-empty string without '/', got {trajectory_id!r}")
    return trajectory_id


@attrs.define(eq=False)
class LiveTrajectory:
    """A registered trajectory: its record, its conversation state and what is generating for it."""

    record: TrajectoryRecord
    tracker: ConversationTracker
    sampling: SamplingDefaults
    lock: asyncio.Lock = attrs.field(factory=asyncio.Lock)  # one turn at a time
    in_flight: dict[str, str] = attrs.field(factory=dict)  # rid -> engine url
    aborted: bool = False
    protocol_state: dict[str, Any] = attrs.field(factory=dict)  # per-protocol stores (e.g. stored responses)
    priority: int | None = None  # sent with each engine call (SGLang's ``priority``: larger runs sooner)


class TrajectoryRegistry:
    """The live trajectories of one router.

    Args:
        renderer: the chat renderer every trajectory's conversation tracker uses.
        abort_at_engine: called for each in-flight request of a trajectory that is aborted or popped.
        forget: called with a trajectory id when it is popped (the engine balancer's stickiness).
        secret: the run secret the per-trajectory keys derive from (``None``: no keys).
        default_sampling: sampling defaults under a trajectory's own.
        max_context_length: the default per-segment token limit.
    """

    def __init__(self, renderer: ChatRenderer, abort_at_engine: AbortAtEngine, forget: Callable[[str], None], *,
                 secret: str | None = None, default_sampling: Mapping[str, Any] | None = None,
                 max_context_length: int | None = None) -> None:
        self.renderer = renderer
        self.abort_at_engine = abort_at_engine
        self.forget = forget
        self.secret = secret
        self.default_sampling = dict(default_sampling or {})
        self.max_context_length = max_context_length
        self._live: dict[str, LiveTrajectory] = {}

    def __len__(self) -> int:
        return len(self._live)

    def key(self, trajectory_id: str, attempt: int = 0) -> str:
        """The API key of a trajectory attempt (any placeholder works without a run secret)."""
        if self.secret is None:
            return "loongsage"
        return derive_trajectory_key(self.secret, check_trajectory_id(trajectory_id), attempt)

    def key_opens(self, token: str, trajectory_id: str, attempt: str) -> bool:
        """Whether ``token`` is the key of ``trajectory_id`` attempt ``attempt`` (a URL segment)."""
        return (self.secret is not None and attempt.isdigit()
                and token_matches(token, derive_trajectory_key(self.secret, trajectory_id, int(attempt))))

    def register(self, trajectory_id: str, attempt: int, sampling: Mapping[str, Any] | SamplingParams | None,
                 max_response_tokens: int | None, max_context_length: int | None,
                 metadata: Mapping[str, Any] | None, priority: int | None = None) -> None:
        """Register (or replace: the old attempt is aborted) a trajectory; bad values are ValueErrors.
        ``priority`` goes with every engine call of the trajectory (SGLang's: larger runs sooner)."""
        check_trajectory_id(trajectory_id)
        if isinstance(sampling, SamplingParams):
            sampling = attrs.asdict(sampling)
        merged = {**self.default_sampling, **dict(sampling or {})}
        check_sampling(merged)
        for name, value in (("max_response_tokens", max_response_tokens), ("max_context_length", max_context_length)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        old = self._live.get(trajectory_id)
        if old is not None:
            self.abort_entry(old)
        record = TrajectoryRecord(trajectory_id=trajectory_id, attempt=int(attempt),
                                  max_response_tokens=max_response_tokens,
                                  max_context_length=max_context_length if max_context_length is not None
                                  else self.max_context_length, metadata=dict(metadata or {}))
        self._live[trajectory_id] = LiveTrajectory(record, ConversationTracker(self.renderer, record.segments),
                                                   SamplingDefaults.from_dict(merged), priority=priority)

    def entry(self, trajectory_id: str) -> LiveTrajectory:
        """The live trajectory (KeyError if unknown)."""
        entry = self._live.get(trajectory_id)
        if entry is None:
            raise KeyError(f"unknown trajectory {trajectory_id!r}")
        return entry

    def is_live(self, entry: LiveTrajectory) -> bool:
        """Whether ``entry`` is still the registered attempt of its trajectory."""
        return self._live.get(entry.record.trajectory_id) is entry

    def snapshot(self, trajectory_id: str) -> TrajectoryRecord:
        """A copy of the trajectory's record as it stands (KeyError if unknown)."""
        return TrajectoryRecord.from_dict(self.entry(trajectory_id).record.to_dict())

    def pop(self, trajectory_id: str) -> TrajectoryRecord:
        """Remove the trajectory and return its record; a turn still generating is aborted and never recorded."""
        entry = self.entry(trajectory_id)
        self.abort_entry(entry, status=None)
        del self._live[trajectory_id]
        self.forget(trajectory_id)
        return entry.record

    def abort(self, trajectory_id: str) -> None:
        """Mark the trajectory aborted and abort its in-flight generation (KeyError if unknown)."""
        self.abort_entry(self.entry(trajectory_id))

    def abort_entry(self, entry: LiveTrajectory,
                    status: TrajectoryStatus | None = TrajectoryStatus.ABORTED) -> None:
        entry.aborted = True
        if status is not None:
            entry.record.status = status
        for rid, url in list(entry.in_flight.items()):
            self.abort_at_engine(url, rid)

    def lookup(self, trajectory_id: str, attempt: str) -> LiveTrajectory:
        """The trajectory a request's URL names; an unknown id or a stale attempt is a 404."""
        entry = self._live.get(trajectory_id)
        if entry is None:
            raise not_found(f"unknown trajectory '{trajectory_id}' (not registered, or already collected)",
                            code="trajectory_not_found")
        if attempt != str(entry.record.attempt):
            raise not_found(f"trajectory '{trajectory_id}' has no attempt {attempt} (current attempt: "
                            f"{entry.record.attempt})", code="stale_attempt")
        return entry

    def admin_lookup(self, trajectory_id: str) -> LiveTrajectory:
        """The trajectory an ``/admin`` URL names; unknown is a 404."""
        entry = self._live.get(trajectory_id)
        if entry is None:
            raise not_found(f"unknown trajectory '{trajectory_id}'", code="trajectory_not_found")
        return entry
