"""What a scheduler remembers: one record per live group, and the state every part reads.

:class:`GroupRecord` is one live group (dispatched and not yet trained, discarded or evicted) and
:class:`GroupState` where it is; :data:`DROP_REASONS` names why :meth:`BaseScheduler.evict
<loongsage_plugin_schedulers.base.BaseScheduler.evict>` removes one. :class:`SchedulerState`
declares the attributes :class:`~loongsage_plugin_schedulers.base.BaseScheduler` sets up and its
parts (places, staleness accounting, checkpoints) share, so each part can be read, and
type-checked, on its own.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import attrs

if TYPE_CHECKING:  # pragma: no cover - typing only
    from loongsage_hookspecs import TrajectoryGroup

DROP_REASONS: tuple[str, ...] = ("stale", "surplus")
"""Why :meth:`BaseScheduler.evict` removes a group: its staleness already exceeds the bound
(``stale``), or it missed the step that was its deadline (``surplus``, only with oversampling)."""


class GroupState(str, enum.Enum):
    """Where a live group is: still generating, or finished and waiting in the buffer."""

    IN_FLIGHT = "in_flight"
    BUFFERED = "buffered"


@attrs.define(eq=False)
class GroupRecord:
    """What a scheduler remembers about one live group.

    ``order`` is its dispatch index (FIFO order), ``version`` the trainer version it was dispatched
    at, ``deadline`` the last trainer version allowed to train it (``None`` when the strategy judges
    staleness from the tokens alone), ``completed`` its completion index once finished, and
    ``oldest`` / ``newest`` the lowest / highest weight version among its generated tokens;
    ``source`` its data source (``None`` when the scheduler has no quota).
    """

    group_id: str
    order: int
    version: int
    deadline: int | None
    state: GroupState = GroupState.IN_FLIGHT
    completed: int = -1
    oldest: int | None = None
    newest: int | None = None
    source: str | None = None


def int_arg(name: str, value: object, minimum: int) -> int:
    """``value`` when it is an int (not a bool) of at least ``minimum``; else the error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class SchedulerState:
    """The state of a scheduler, set by ``BaseScheduler.__init__``, and its lookups and checks.

    Settings: ``batch_size``, ``stale_steps``, ``oversample``, ``staleness`` (the mode), ``per_step``
    and the quota function. Live groups: ``_records`` (dispatch order), ``_buffered`` (completion
    order), ``_slot_live`` (``(deadline, source) -> live groups holding it``), ``_n_in_flight``.
    Where the run is: ``_version``, ``_selected_at`` (the version whose batch was taken, until
    ``on_train_step``), and the counters a checkpoint keeps. The methods find a live group, forget
    one, and check the controller's version and buffer against this state.
    """

    name: ClassVar[str]
    batch_size: int
    stale_steps: int
    oversample: float
    staleness: str
    per_step: int
    _quota_fn: Callable[[int], Mapping[str, int]] | None
    _quotas: dict[int, dict[str | None, int]]
    _version: int | None
    _records: dict[str, GroupRecord]
    _buffered: dict[str, GroupRecord]
    _slot_live: dict[tuple[int, str | None], int]
    _selected_at: int | None
    _next_order: int
    _next_completion: int
    _n_in_flight: int
    _dispatched_total: int
    _discarded_total: int
    _trained_total: int
    _dropped_total: dict[str, int]
    _dropped_at_last_step: dict[str, int]
    _dropped_last_step: dict[str, int]
    _last_batch: dict[str, float]

    # ------------------------------------------------------------------ lookups and consistency checks

    def _record(self, group_id: str, where: str) -> GroupRecord:
        rec = self._records.get(group_id) if isinstance(group_id, str) else None
        if rec is None:
            raise ValueError(f"{where}: group {group_id!r} is not live (never dispatched, or already trained, "
                             "discarded or evicted)")
        return rec

    def _forget(self, rec: GroupRecord) -> None:
        del self._records[rec.group_id]
        if rec.state is GroupState.IN_FLIGHT:
            self._n_in_flight -= 1
        else:
            del self._buffered[rec.group_id]

    def _peek_version(self, version: int, where: str) -> int:
        int_arg(f"{where}: trainer_version", version, 0)
        if self._version is not None and version != self._version:
            raise ValueError(f"{where}: trainer_version {version} but the scheduler is at version {self._version} "
                             "(call on_train_step once after each train step)")
        return version

    def _adopt_version(self, version: int, where: str) -> int:
        t = self._peek_version(version, where)
        if self._version is None:
            self._version = t
        return t

    def _check_buffer(self, buffer: Sequence["TrajectoryGroup"], where: str) -> dict[str, "TrajectoryGroup"]:
        """``group_id -> group`` of ``buffer`` after checking that it holds exactly the groups the
        scheduler knows as buffered (so controller and scheduler cannot drift apart silently)."""
        by_id: dict[str, TrajectoryGroup] = {getattr(g, "group_id", None): g for g in buffer}  # type: ignore[misc]
        if len(by_id) == len(buffer) == len(self._buffered) and by_id.keys() == self._buffered.keys():
            return by_id
        seen: set[object] = set()
        for g in buffer:
            gid = getattr(g, "group_id", None)
            if gid in seen:
                raise ValueError(f"{where}: buffer holds group {gid!r} twice")
            seen.add(gid)
            if gid not in self._buffered:
                raise ValueError(f"{where}: buffer holds group {gid!r}, which the scheduler does not know as "
                                 "finished; call on_complete before adding a group to the buffer")
        missing = [gid for gid in self._buffered if gid not in by_id]
        raise ValueError(f"{where}: groups {missing[:5]} were reported complete but are not in the buffer; "
                         "remove groups only as select/evict return them, or call on_discard")
