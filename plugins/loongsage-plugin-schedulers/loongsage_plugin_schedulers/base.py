"""Bookkeeping shared by every scheduler strategy of this package.

A scheduler is a pure state machine: its state changes only through the event methods of the
``loongsage_hookspecs.Scheduler`` protocol (``on_dispatch``, ``on_complete``, ``on_discard``,
``evict``, ``select``, ``on_train_step``); ``can_dispatch``, ``to_abort`` and ``metrics`` only read
it. There are no threads, clocks or random numbers, so the same sequence of calls always gives the
same decisions, which is what makes the strategies testable in a simulated pipeline.

:class:`BaseScheduler` keeps one :class:`GroupRecord` per live group (dispatched and not yet
trained, discarded or evicted) and validates every call, raising an error that names the group or
value at fault when the controller and the scheduler disagree. A strategy subclass supplies three
rules: :meth:`BaseScheduler._may_dispatch`, :meth:`BaseScheduler._deadline_for` and
:meth:`BaseScheduler._choose`.

Deadlines. Strategies that bound staleness by construction (``sync``, ``window_gated``,
``windowed_fifo``) give each group a *deadline* when it is dispatched: the last trainer version
that may train it. A group that has not been trained when the step at its deadline has taken its
batch can never be trained (it is the unused surplus of oversampling): :meth:`to_abort` lists it
while it is in flight and :meth:`evict` returns it once it is in the buffer.

Source quotas. Built with a ``quota`` in its context (a function from a trainer version to the
groups each data source contributes to the step at that version, adding up to ``batch_size``), a
scheduler keeps every step's mix: places (slots, capacity, rounds) are counted per source, :meth:`next_source`
tells the producer which source to draw the next prompt from, and a step takes exactly each
source's quota. A source's places per step are ``ceil(quota * (1 + oversample))``. Without
``quota`` every group counts as one anonymous source with ``per_step`` places.

Parts. The class is assembled from :mod:`.records` (the state, what is remembered per group and
the consistency checks), :mod:`.places` (places per source and step, capacity), :mod:`.accounting`
(staleness tests and metrics) and :mod:`.checkpoint` (``state_dict``); this module keeps the
protocol's queries and events and the strategy rules, and re-exports :data:`DROP_REASONS`,
:class:`GroupRecord` and :class:`GroupState`.

State. :meth:`BaseScheduler.state_dict` holds what outlives the groups of one process (the
version and the run's counters); live groups are not in it: a resumed run generates the prompts
of every group that was generating or buffered again, so it starts with an empty pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from .accounting import StalenessAccounting
from .checkpoint import CheckpointState
from .records import DROP_REASONS, GroupRecord, GroupState, int_arg
from .staleness import check_mode, generated_versions, token_staleness_mean

__all__ = ["DROP_REASONS", "BaseScheduler", "GroupRecord", "GroupState"]

if TYPE_CHECKING:  # pragma: no cover - typing only
    from loongsage_hookspecs import SchedulerContext, TrajectoryGroup


class BaseScheduler(StalenessAccounting, CheckpointState):
    """Shared state, validation and metrics of the scheduler strategies.

    Built ``cls(ctx, **scheduler_args)``. From the host's context (a ``SchedulerContext``):

    * ``ctx.batch_size``: prompt groups one train step consumes (``rollout.prompts_per_step``).
    * ``ctx.stale_steps``: the staleness bound ``s`` (``async.stale_steps``); no trained group is
      more than ``s`` versions old (``sync`` ignores it: its bound is 0).
    * ``ctx.quota``: optional, ``quota(version) -> {source: groups}`` (non-negative integers adding
      up to ``batch_size``): the step at that version trains exactly that many groups of each
      source; the host passes its per-step rounding of the ``[[data]]`` weights.

    Arguments (keyword only, as a job file's ``[async] scheduler_args`` gives them):

    * ``oversample``: a ratio >= 0; ``per_step = ceil(batch_size * (1 + oversample))`` groups are
      generated for each step so that filter drops still leave ``batch_size`` groups.
    * ``staleness``: ``"oldest"`` (default) or ``"newest"``: which token's version defines a group's
      staleness (see :mod:`loongsage_plugin_schedulers.staleness`).

    ``capacity = per_step * (1 + bound)`` groups may be in flight and buffered together (with a
    quota: the places of every source over the versions ``[t, t + bound]``).
    """

    name: ClassVar[str] = "base"

    def __init__(self, ctx: "SchedulerContext", *, oversample: float = 0.0, staleness: str = "oldest") -> None:
        batch_size, stale_steps, quota = ctx.batch_size, ctx.stale_steps, ctx.quota
        self.batch_size = int_arg("batch_size", batch_size, 1)
        self.stale_steps = int_arg("stale_steps", stale_steps, 0)
        if isinstance(oversample, bool) or not isinstance(oversample, (int, float)):
            raise TypeError(f"oversample must be a number >= 0, got {type(oversample).__name__} {oversample!r}")
        if not math.isfinite(oversample) or oversample < 0:
            raise ValueError(f"oversample must be a finite number >= 0, got {oversample}")
        self.oversample = float(oversample)
        self.staleness = check_mode(staleness)
        # round() first so that e.g. 8 * 1.1 = 8.800000000000001 does not become 9 by float noise.
        self.per_step = math.ceil(round(self.batch_size * (1.0 + self.oversample), 9))
        if quota is not None and not callable(quota):
            raise TypeError(f"quota must be a function of the trainer version, got {type(quota).__name__}")
        self._quota_fn = quota
        self._quotas: dict[int, dict[str | None, int]] = {}

        self._version: int | None = None
        self._records: dict[str, GroupRecord] = {}  # live groups, in dispatch order
        self._buffered: dict[str, GroupRecord] = {}  # the buffered ones among them, in completion order
        self._slot_live: dict[tuple[int, str | None], int] = {}  # (deadline, source) -> live groups holding it
        self._selected_at: int | None = None  # version whose batch was taken, until on_train_step
        self._next_order = 0
        self._next_completion = 0
        self._n_in_flight = 0
        self._dispatched_total = 0
        self._discarded_total = 0
        self._trained_total = 0
        self._dropped_total = dict.fromkeys(DROP_REASONS, 0)
        self._dropped_at_last_step = dict.fromkeys(DROP_REASONS, 0)
        self._dropped_last_step = dict.fromkeys(DROP_REASONS, 0)
        self._last_batch: dict[str, float] = {"mean": 0.0, "max": 0.0, "min": 0.0, "token_mean": 0.0}

    # ------------------------------------------------------------------ read-only state

    @property
    def version(self) -> int | None:
        """The trainer version the scheduler is at (``None`` until the first event)."""
        return self._version

    @property
    def in_flight(self) -> int:
        """Groups dispatched and not yet completed or discarded."""
        return self._n_in_flight

    @property
    def buffered(self) -> int:
        """Groups completed and not yet selected, evicted or discarded."""
        return len(self._buffered)

    def deadline_of(self, group_id: str) -> int | None:
        """The last trainer version allowed to train live group ``group_id`` (``None``: judged by its
        tokens only)."""
        return self._record(group_id, "deadline_of").deadline

    # ------------------------------------------------------------------ protocol: queries

    def can_dispatch(self, in_flight: int, buffered: int, trainer_version: int) -> bool:
        """Whether the producer may dispatch one more prompt group now.

        ``in_flight`` and ``buffered`` are the controller's counts; the larger of them and the
        scheduler's own counts is held against ``capacity``, so neither view can overfill the
        pipeline.
        """
        int_arg("in_flight", in_flight, 0)
        int_arg("buffered", buffered, 0)
        t = self._peek_version(trainer_version, "can_dispatch")
        occupied = max(in_flight + buffered, self._n_in_flight + len(self._buffered))
        if occupied >= self.capacity:
            return False
        return any(self._may_dispatch(t, in_flight, buffered, s) for s in self.quota(t))

    def next_source(self, trainer_version: int) -> str | None:
        """The data source the next dispatched group should come from (a read), or ``None``: any
        source (no quota), or nothing may be dispatched now. Among the sources with a free place,
        the one whose place is due first, then the least filled, then the quota's order."""
        if self._quota_fn is None:
            return None
        t = self._peek_version(trainer_version, "next_source")
        if self._n_in_flight + len(self._buffered) >= self.capacity:
            return None
        open_ = [s for s in self.quota(t) if self._may_dispatch(t, self._n_in_flight, len(self._buffered), s)]
        if not open_:
            return None
        order = {s: i for i, s in enumerate(self.quota(t))}
        return min(open_, key=lambda s: (*self._dispatch_rank(t, s), order[s]))

    def to_abort(self, trainer_version: int) -> list[str]:
        """Ids of in-flight groups that can no longer be trained (missed their deadline), in dispatch
        order. The controller may abort them on the engines and call :meth:`on_discard`; if it lets
        them finish instead, :meth:`evict` returns them."""
        t = self._peek_version(trainer_version, "to_abort")
        return [r.group_id for r in self._records.values()
                if r.state is GroupState.IN_FLIGHT and self._missed_deadline(r, t)]

    # ------------------------------------------------------------------ protocol: events

    def on_dispatch(self, group_id: str, version: int, source: str | None = None) -> None:
        """Record that ``group_id`` was dispatched while the engines serve ``version``.

        With a quota, ``source`` (the group's data source) is required and must have a free place
        (:meth:`next_source` names one); without, it is ignored. Raises ``RuntimeError`` if
        :meth:`can_dispatch` would have said no (by the scheduler's own counts), and ``ValueError``
        if ``group_id`` is already live or ``source`` is unknown. An id may be dispatched again
        after its previous group was trained, discarded or evicted (a re-queued prompt).
        """
        if not isinstance(group_id, str) or not group_id:
            raise ValueError(f"on_dispatch: group_id must be a non-empty string, got {group_id!r}")
        if group_id in self._records:
            raise ValueError(f"on_dispatch: group {group_id!r} is already live ({self._records[group_id].state.value})")
        t = self._adopt_version(version, "on_dispatch")
        if self._quota_fn is None:
            source = None
        elif source not in self.quota(t):
            raise ValueError(f"on_dispatch: group {group_id!r} has source {source!r}, not one of the quota's "
                             f"{sorted(k for k in self.quota(t) if k is not None)}")
        if self._n_in_flight + len(self._buffered) >= self.capacity or not self._may_dispatch(
                t, self._n_in_flight, len(self._buffered), source):
            raise RuntimeError(
                f"on_dispatch: {self.name} does not allow dispatching group {group_id!r} "
                f"{'' if source is None else f'of source {source!r} '}at version {t} "
                f"(in flight {self._n_in_flight}, buffered {len(self._buffered)}, capacity {self.capacity}); "
                "dispatch only while can_dispatch() is true (and from next_source())")
        deadline = self._deadline_for(t, source)
        self._records[group_id] = GroupRecord(group_id=group_id, order=self._next_order, version=t,
                                              deadline=deadline, source=source)
        self._next_order += 1
        if deadline is not None:
            key = (deadline, source)
            self._slot_live[key] = self._slot_live.get(key, 0) + 1
        self._n_in_flight += 1
        self._dispatched_total += 1

    def on_complete(self, group: "TrajectoryGroup") -> None:
        """Record that ``group`` finished and was kept (it enters the controller's buffer now).

        Raises ``ValueError`` if it was not in flight, or if a generated token carries a weight
        version newer than the trainer's (a bookkeeping error upstream).
        """
        gid = getattr(group, "group_id", None)
        rec = self._records.get(gid) if isinstance(gid, str) else None
        if rec is None or rec.state is not GroupState.IN_FLIGHT:
            state = "unknown" if rec is None else rec.state.value
            raise ValueError(f"on_complete: group {gid!r} is not in flight ({state}); call on_dispatch first, "
                             "and on_complete once")
        if rec.source is not None and getattr(group, "source", rec.source) != rec.source:
            raise ValueError(f"on_complete: group {gid!r} has source {group.source!r} but was dispatched for "
                             f"{rec.source!r}")
        versions = list(generated_versions(group))
        if versions and self._version is not None and max(versions) > self._version:
            raise ValueError(f"on_complete: group {gid!r} has a token of weight version {max(versions)}, newer than "
                             f"the trainer version {self._version}")
        rec.oldest = min(versions) if versions else None
        rec.newest = max(versions) if versions else None
        rec.state = GroupState.BUFFERED
        rec.completed = self._next_completion
        self._next_completion += 1
        self._n_in_flight -= 1
        self._buffered[rec.group_id] = rec

    def on_discard(self, group_id: str) -> None:
        """Forget live group ``group_id``: filtered out, failed, aborted, or removed from the buffer by
        the controller. A discard frees its place, so the producer may dispatch a replacement."""
        rec = self._record(group_id, "on_discard")
        self._forget(rec)
        self._discarded_total += 1
        self._release_slot(rec)

    def evict(self, buffer: Sequence["TrajectoryGroup"], trainer_version: int) -> list["TrajectoryGroup"]:
        """Remove from the scheduler's view, and return, the buffered groups that can no longer be
        trained: staleness already above the bound (``stale``) or past their deadline
        (``surplus``). The controller takes them out of its buffer and drops them or dispatches their
        prompts again. Returned in buffer order."""
        t = self._adopt_version(trainer_version, "evict")
        by_id = self._check_buffer(buffer, "evict")
        out = []
        for gid, group in by_id.items():
            rec = self._buffered[gid]
            reason = "surplus" if self._missed_deadline(rec, t) else "stale" if self._too_stale(rec, t) else None
            if reason is None:
                continue
            self._forget(rec)
            self._dropped_total[reason] += 1
            self._release_slot(rec)
            out.append(group)
        return out

    def select(self, buffer: Sequence["TrajectoryGroup"], trainer_version: int,
               batch_size: int | None = None) -> list["TrajectoryGroup"] | None:
        """The groups the next train step takes (exactly ``batch_size`` of them), or ``None`` to wait.

        The chosen groups leave the scheduler's view; the controller removes them from its buffer.
        No selected group exceeds the staleness bound. After a batch, call :meth:`on_train_step`
        before selecting again. ``batch_size``, if given, must equal the configured one.
        """
        if batch_size is not None and batch_size != self.batch_size:
            raise ValueError(f"select: batch_size {batch_size} differs from the scheduler's batch_size "
                             f"{self.batch_size}; build the scheduler with the step's prompt count")
        t = self._adopt_version(trainer_version, "select")
        if self._selected_at == t:
            raise RuntimeError(f"select: a batch was already taken at version {t}; train it and call "
                               f"on_train_step({t + 1}) first")
        by_id = self._check_buffer(buffer, "select")
        chosen = self._choose(t)
        if chosen is None:
            return None
        counts: dict[str | None, int] = {}
        for r in chosen:
            counts[r.source] = counts.get(r.source, 0) + 1
        if len(chosen) != self.batch_size or any(
                r.state is not GroupState.BUFFERED or self._too_stale(r, t) or self._missed_deadline(r, t)
                for r in chosen) or any(counts.get(s, 0) != q for s, q in self.quota(t).items()):
            raise RuntimeError(f"{self.name}: internal error, chose an invalid batch at version {t}")
        groups = [by_id[r.group_id] for r in chosen]
        for r in chosen:
            self._forget(r)
        self._trained_total += len(chosen)
        self._selected_at = t
        stale = [self._staleness(r, t) for r in chosen]
        self._last_batch = {"mean": sum(stale) / len(stale), "max": float(max(stale)), "min": float(min(stale)),
                            "token_mean": token_staleness_mean(groups, t)}
        return groups

    def on_train_step(self, new_version: int) -> None:
        """The step that trained the last selected batch finished and the engines now serve
        ``new_version``, which must be that batch's version + 1."""
        int_arg("new_version", new_version, 0)
        if self._selected_at is None:
            raise RuntimeError(f"on_train_step({new_version}): no batch was selected since the last step")
        if new_version != self._selected_at + 1:
            raise ValueError(f"on_train_step: new_version must be {self._selected_at + 1} (the selected batch's "
                             f"version + 1), got {new_version}")
        self._version = new_version
        self._selected_at = None
        for reason in DROP_REASONS:
            self._dropped_last_step[reason] = self._dropped_total[reason] - self._dropped_at_last_step[reason]
            self._dropped_at_last_step[reason] = self._dropped_total[reason]
        for slot in [k for k in self._slot_live if k[0] < new_version]:
            del self._slot_live[slot]
        for v in [v for v in self._quotas if v < new_version]:
            del self._quotas[v]

    # ------------------------------------------------------------------ strategy rules

    def _may_dispatch(self, t: int, in_flight: int, buffered: int, source: str | None) -> bool:
        """Strategy rule: may one more group of ``source`` be dispatched at version ``t`` (capacity
        already checked)?"""
        raise NotImplementedError

    def _deadline_for(self, t: int, source: str | None) -> int | None:
        """Strategy rule: the deadline of a group of ``source`` dispatched now (``_may_dispatch`` said yes)."""
        raise NotImplementedError

    def _dispatch_rank(self, t: int, source: str | None) -> tuple[float, float]:
        """Strategy rule for :meth:`next_source` (smaller first): when the source's free place is
        due, and how full its places are. Default: by fill of the source's live groups against its
        places over the window."""
        cap = sum(self.seats(v, source) for v in range(t, t + self.bound + 1))
        return (float(t), self.live_count(source) / max(cap, 1))

    def _choose(self, t: int) -> list[GroupRecord] | None:
        """Strategy rule: the records of the batch at version ``t`` (exactly ``batch_size`` buffered,
        trainable ones), or ``None`` to wait."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers for strategies

    def _live(self) -> list[GroupRecord]:
        """Live records in dispatch order."""
        return list(self._records.values())
