"""Checkpoint state of a scheduler: the version and the run's counters, as JSON.

Live groups are not kept: a resumed run generates the prompts of every group that was generating
or buffered again, so it starts with an empty pipeline, and only what outlives one process's
groups (the trainer version, the dispatch index, the totals and the last step's drops and batch
staleness) is saved and restored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .records import DROP_REASONS, SchedulerState, int_arg


class CheckpointState(SchedulerState):
    """The checkpoint part of :class:`~loongsage_plugin_schedulers.base.BaseScheduler`."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON-able): the version and the run's counters. Live groups are
        not kept: a resumed run dispatches their prompts again into an empty pipeline."""
        return {"name": self.name, "version": self._version, "next_order": self._next_order,
                "dispatched_total": self._dispatched_total, "discarded_total": self._discarded_total,
                "trained_total": self._trained_total, "dropped_total": dict(self._dropped_total),
                "dropped_last_step": dict(self._dropped_last_step), "last_batch": dict(self._last_batch)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` of an earlier run (into a scheduler with no live group)."""
        if self._records or self._selected_at is not None:
            raise RuntimeError("load_state_dict: the scheduler already has live groups or a selected batch")
        if state.get("name") not in (None, self.name):
            raise ValueError(f"load_state_dict: the state is of scheduler {state.get('name')!r}, not {self.name!r}")
        version = state.get("version")
        self._version = None if version is None else int_arg("version", version, 0)
        self._next_order = int_arg("next_order", state.get("next_order", 0), 0)
        self._dispatched_total = int_arg("dispatched_total", state.get("dispatched_total", 0), 0)
        self._discarded_total = int_arg("discarded_total", state.get("discarded_total", 0), 0)
        self._trained_total = int_arg("trained_total", state.get("trained_total", 0), 0)
        for reason in DROP_REASONS:
            self._dropped_total[reason] = int(state.get("dropped_total", {}).get(reason, 0))
            self._dropped_at_last_step[reason] = self._dropped_total[reason]
            self._dropped_last_step[reason] = int(state.get("dropped_last_step", {}).get(reason, 0))
        self._last_batch = {k: float(state.get("last_batch", {}).get(k, 0.0))
                            for k in ("mean", "max", "min", "token_mean")}
