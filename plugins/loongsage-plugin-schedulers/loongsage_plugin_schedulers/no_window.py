"""``no_window``: keep the pipeline full, train on whatever finished first, drop what got too old.

The producer dispatches whenever fewer than ``capacity = per_step * (1 + stale_steps)`` groups
are in flight or buffered; nothing ties a group to a step. A step takes the first ``batch_size``
finished groups in completion order among those whose staleness is at most ``stale_steps``. A
buffered group whose staleness exceeds the bound is evicted (``rollout/dropped_stale``): the
bound is enforced by dropping, so slow (long) generations are the ones most likely to be lost.
"""

from __future__ import annotations

from .base import BaseScheduler, GroupRecord


class NoWindowScheduler(BaseScheduler):
    """Dispatch up to capacity, train in completion order, evict groups staler than ``stale_steps``."""

    name = "no_window"

    def _may_dispatch(self, t: int, in_flight: int, buffered: int) -> bool:
        return True  # capacity is the only limit (checked by the base class)

    def _deadline_for(self, t: int) -> None:
        return None

    def _choose(self, t: int) -> list[GroupRecord] | None:
        ready = self._trainable_buffered(t)
        return ready[:self.batch_size] if len(ready) >= self.batch_size else None
