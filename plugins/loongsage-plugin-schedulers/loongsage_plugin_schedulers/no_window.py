"""``no_window``: keep the pipeline full, train on whatever finished first, drop what got too old.

The producer dispatches whenever fewer than ``capacity = per_step * (1 + stale_steps)`` groups
are in flight or buffered; nothing ties a group to a step. A step takes the first ``batch_size``
finished groups in completion order among those whose staleness is at most ``stale_steps``. A
buffered group whose staleness exceeds the bound is evicted (``rollout/dropped_stale``): the
bound is enforced by dropping, so slow (long) generations are the ones most likely to be lost.
With a quota, each source may hold its places over ``stale_steps + 1`` steps, and a step takes
the first groups of each source up to its quota.
"""

from __future__ import annotations

from .base import BaseScheduler, GroupRecord


class NoWindowScheduler(BaseScheduler):
    """Dispatch up to capacity, train in completion order, evict groups staler than ``stale_steps``."""

    name = "no_window"

    def _may_dispatch(self, t: int, in_flight: int, buffered: int, source: str | None) -> bool:
        if not self.has_quota:
            return True  # capacity is the only limit (checked by the base class)
        cap = sum(self.seats(v, source) for v in range(t, t + self.bound + 1))
        return self.live_count(source) < cap  # each source's share of the capacity

    def _deadline_for(self, t: int, source: str | None) -> None:
        return None

    def _choose(self, t: int) -> list[GroupRecord] | None:
        chosen: list[GroupRecord] = []
        for source, rows in self._per_source(self._trainable_buffered(t), t).items():
            need = self.quota(t)[source]
            if len(rows) < need:
                return None
            chosen += rows[:need]
        return sorted(chosen, key=lambda r: r.completed)
