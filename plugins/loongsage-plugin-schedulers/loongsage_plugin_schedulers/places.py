"""Places: how many groups a scheduler may hold, per data source and per step.

Without a quota every group counts as one anonymous source with ``per_step`` places a step; with
one (``quota(version) -> {source: groups}``), a source's places in a step are its quota,
oversampled: ``ceil(quota * (1 + oversample))``. ``capacity`` adds the places of every source over
the versions ``[t, t + bound]``; a group dispatched with a deadline holds a place under that
deadline (``_slot_live``) until it is trained, discarded or evicted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from .records import GroupRecord, SchedulerState


class SchedulerPlaces(SchedulerState):
    """The places part of :class:`~loongsage_plugin_schedulers.base.BaseScheduler` (see the module docstring)."""

    @property
    def bound(self) -> int:
        """The staleness bound this strategy guarantees (``stale_steps``; 0 for ``sync``)."""
        return self.stale_steps

    @property
    def capacity(self) -> int:
        """Groups that may be in flight and buffered together now: ``per_step * (1 + bound)``, or
        with a quota, every source's places over the versions ``[t, t + bound]``."""
        if self._quota_fn is None:
            return self.per_step * (1 + self.bound)
        t = self._version or 0
        return sum(self.seats(v, s) for v in range(t, t + self.bound + 1) for s in self.quota(v))

    @property
    def has_quota(self) -> bool:
        """Whether the scheduler keeps per-source quotas (built with ``quota``)."""
        return self._quota_fn is not None

    def quota(self, version: int) -> dict[str | None, int]:
        """Groups of each source the step at ``version`` trains (``{None: batch_size}`` without a quota)."""
        if self._quota_fn is None:
            return {None: self.batch_size}
        got = self._quotas.get(version)
        if got is None:
            raw = self._quota_fn(version)
            if not isinstance(raw, Mapping) or not raw or any(
                    not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 0
                    for k, v in raw.items()) or sum(raw.values()) != self.batch_size:
                raise ValueError(f"quota({version}) must map source names to counts >= 0 adding up to batch_size "
                                 f"{self.batch_size}, got {raw!r}")
            got = dict(raw)
            self._quotas[version] = got
        return got

    def seats(self, version: int, source: str | None) -> int:
        """Places of ``source`` in the step at ``version``: its quota, oversampled (``per_step``
        without a quota)."""
        if self._quota_fn is None:
            return self.per_step
        return math.ceil(round(self.quota(version).get(source, 0) * (1.0 + self.oversample), 9))

    def live_count(self, source: str | None) -> int:
        """Live groups (in flight or buffered) of ``source``."""
        return sum(1 for r in self._records.values() if r.source == source)

    def _open_slot(self, t: int, source: str | None) -> int | None:
        """Lowest deadline in the window ``[t, t + bound]`` with a free place of ``source`` (fewer live
        groups than :meth:`seats`); ``t`` itself is closed once its batch was taken. ``None`` when
        the window is full."""
        start = t + 1 if self._selected_at == t else t
        for slot in range(start, t + self.bound + 1):
            if self._slot_live.get((slot, source), 0) < self.seats(slot, source):
                return slot
        return None

    def _per_source(self, records: Sequence[GroupRecord], t: int) -> dict[str | None, list[GroupRecord]]:
        """``records`` split by source (each list in the given order), for every source of ``quota(t)``."""
        out: dict[str | None, list[GroupRecord]] = {s: [] for s in self.quota(t)}
        for r in records:
            if r.source in out:
                out[r.source].append(r)
        return out

    def _release_slot(self, rec: GroupRecord) -> None:
        """A group that will never be trained gives its place under its deadline back."""
        key = (rec.deadline, rec.source)
        if rec.deadline is not None and key in self._slot_live:
            self._slot_live[key] -= 1
