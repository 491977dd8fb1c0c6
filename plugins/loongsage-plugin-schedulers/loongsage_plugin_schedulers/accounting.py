"""Staleness accounting: whether a group may still be trained, and the metrics of the step log.

A buffered group is *too stale* at trainer version ``t`` when ``t`` minus the version of its oldest
(or, with ``staleness = "newest"``, newest) generated token exceeds the bound; it *missed its
deadline* when ``t`` is past its deadline, or at it once that step's batch was taken. The metrics
report the staleness of the last selected batch, the pipeline's fill and the groups dropped.
"""

from __future__ import annotations

from .places import SchedulerPlaces
from .records import DROP_REASONS, GroupRecord


class StalenessAccounting(SchedulerPlaces):
    """The staleness and metrics part of :class:`~loongsage_plugin_schedulers.base.BaseScheduler`."""

    def _staleness(self, rec: GroupRecord, t: int) -> int:
        ref = rec.oldest if self.staleness == "oldest" else rec.newest
        return 0 if ref is None else t - ref

    def _too_stale(self, rec: GroupRecord, t: int) -> bool:
        ref = rec.oldest if self.staleness == "oldest" else rec.newest
        return ref is not None and t - ref > self.bound  # in-flight records have no ref yet

    def _missed_deadline(self, rec: GroupRecord, t: int) -> bool:
        if rec.deadline is None:
            return False
        return rec.deadline < t or (rec.deadline == t and self._selected_at == t)

    def _trainable_buffered(self, t: int) -> list[GroupRecord]:
        """Buffered records that may be trained at ``t``, in completion order."""
        return [r for r in self._buffered.values() if not self._too_stale(r, t) and not self._missed_deadline(r, t)]

    def metrics(self) -> dict[str, float]:
        """Metrics for the step log (a pure read; the per-step drop counts are frozen at each
        :meth:`on_train_step`).

        * ``rollout/staleness_mean|max|min``: staleness (this scheduler's definition) of the groups of
          the most recently selected batch; ``rollout/staleness_token_mean``: its per-token mean.
        * ``rollout/pipeline_buf_size``, ``rollout/pipeline_in_flight``: groups buffered / generating
          now; ``rollout/pipeline_capacity``: the most both may hold together.
        * ``rollout/dropped_stale``, ``rollout/dropped_surplus``: groups :meth:`evict` returned during
          the last completed step (between the two latest ``on_train_step`` calls); the
          ``*_total`` variants count the whole run.
        * ``rollout/dispatched_total``, ``rollout/discarded_total``, ``rollout/trained_total``.
        """
        out = {
            "rollout/staleness_mean": self._last_batch["mean"],
            "rollout/staleness_max": self._last_batch["max"],
            "rollout/staleness_min": self._last_batch["min"],
            "rollout/staleness_token_mean": self._last_batch["token_mean"],
            "rollout/pipeline_buf_size": float(len(self._buffered)),
            "rollout/pipeline_in_flight": float(self._n_in_flight),
            "rollout/pipeline_capacity": float(self.capacity),
            "rollout/dispatched_total": float(self._dispatched_total),
            "rollout/discarded_total": float(self._discarded_total),
            "rollout/trained_total": float(self._trained_total),
        }
        for reason in DROP_REASONS:
            out[f"rollout/dropped_{reason}"] = float(self._dropped_last_step[reason])
            out[f"rollout/dropped_{reason}_total"] = float(self._dropped_total[reason])
        return out
