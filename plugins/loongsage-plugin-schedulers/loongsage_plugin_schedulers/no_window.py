"""``no_window``: keep the pipeline full, train on whatever finished first, drop what got too old.

The producer dispatches whenever fewer than ``capacity = per_step * (1 + stale_steps)`` groups
are in flight or buffered; nothing ties a group to a step. A step takes the first ``batch_size``
finished groups in completion order among those whose staleness is at most ``stale_steps``. A
buffered group whose staleness exceeds the bound is evicted (``rollout/dropped_stale``): the
bound is enforced by dropping, so slow (long) generations are the ones most likely to be lost.
With a quota, each source may hold its places over ``stale_steps + 1`` steps, and a step takes
the first groups of each source up to its quota.

``fill`` says how full the producer keeps the pipeline:

* ``"capacity"`` (the default): ``capacity`` groups live at all times. Once the step at version
  ``t`` has taken its batch, a group started now can only be trained by the steps ``t + 1`` to
  ``t + stale_steps``, which have ``stale_steps`` steps' places, not ``stale_steps + 1``: the
  groups that finish fast (short generations) are made one step's worth too many and the excess
  is evicted as stale. Fastest, at that waste.
* ``"trainable"``: live groups (per source, with a quota) never exceed the places of the steps
  that can still train a group started now (``t + 1`` to ``t + stale_steps`` after the step at
  ``t`` took its batch, ``t`` to ``t + stale_steps`` before). A group that finishes within its
  version then always has a place in time; only a generation that outlives the bound is evicted
  (with ``staleness = "newest"`` and partial rollout, one that continued under newer weights
  counts by its last token and is kept).
* ``"ahead"``: as ``"trainable"``, but a group still generating after a weight update (dispatched
  at an older version) no longer holds a place: with ``staleness = "newest"`` it will count by
  its last token whenever it finishes, so the producer starts new groups beside the slow ones
  (within ``capacity``). Groups that then finish together beyond the places are evicted: a little
  waste for less waiting on slow generations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import BaseScheduler, GroupRecord, GroupState

if TYPE_CHECKING:  # pragma: no cover
    from loongsage_hookspecs import SchedulerContext

FILL_MODES = ("capacity", "trainable", "ahead")


class NoWindowScheduler(BaseScheduler):
    """Dispatch up to capacity, train in completion order, evict groups staler than ``stale_steps``."""

    name = "no_window"

    def __init__(self, ctx: "SchedulerContext", *, oversample: float = 0.0, staleness: str = "oldest",
                 fill: str = "capacity") -> None:
        super().__init__(ctx, oversample=oversample, staleness=staleness)
        if fill not in FILL_MODES:
            raise ValueError(f"fill: unknown mode {fill!r}; choose one of {', '.join(FILL_MODES)}")
        self.fill = fill

    def _may_dispatch(self, t: int, in_flight: int, buffered: int, source: str | None) -> bool:
        if self.fill != "capacity":
            first = t + 1 if self._selected_at == t else t  # the step at t has taken its batch already
            places = sum(self.seats(v, source) for v in range(first, t + self.bound + 1))
            holding = [r for r in self._records.values() if r.source == source]
            if self.fill == "ahead":  # generations that outlived an update will be fresh when they finish
                holding = [r for r in holding if not (r.state is GroupState.IN_FLIGHT and r.version < t)]
            return len(holding) < places
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
