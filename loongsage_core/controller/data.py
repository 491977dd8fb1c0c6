"""Prompt data: deterministic shuffling, multi-source mixing, resumable cursors.

Each ``[[data]]`` source's rows (read by :mod:`loongsage_core.data_sources`) are consumed
epoch by epoch in a shuffled order fixed by ``(run seed, source name, epoch)``; its cursor is part
of every checkpoint, so a resumed run continues with exactly the prompts an uninterrupted run
would have drawn.

Mixing has two levels, each with its own documented rounding rule.

* Across steps (:class:`DataMixer`): prompts are handed out one at a time by the quota method of
  Balinski and Young, a largest-share rule on the running quota that never lets a source run
  ahead of its upper quota: the next prompt goes to the source with the largest
  ``weight / (drawn + 1)`` among those whose count so far is below ``weight / sum(weights) *
  prompts drawn so far including this one``. After ``h`` prompts in total, every source has drawn
  ``floor`` or ``ceil`` of its exact share ``h * weight / sum(weights)`` (so over any number of
  steps it is within one prompt of that share, and exactly on it whenever the share is whole).
* Inside a step (:func:`.mixing.interleave_by_source`): the step's rows are ordered so that every
  mini-batch, and every data-parallel shard of a mini-batch, holds each source's share of its
  parent rounded down or up (``floor`` or ``ceil`` of ``size * rows_of_source / rows``), with the
  counts of every source adding up exactly to what the parent holds.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

from ..config import JobConfig
from ..data_sources import load_rows
from .mixing import integer_weights, interleave_by_source, quota_sequence, round_shares

__all__ = ["DataMixer", "Prompt", "integer_weights", "interleave_by_source", "quota_sequence", "round_shares"]


@attrs.define
class Prompt:
    """One prompt drawn for a step: a stable id, its source and the row's fields."""

    prompt_id: str
    source: str
    prompt: Any
    label: Any
    metadata: dict[str, Any]


# --------------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------------


@attrs.define
class SourceCursor:
    """Position inside one source: epoch and offset into that epoch's shuffled order."""

    epoch: int = 0
    offset: int = 0


class SourceStream:
    """Rows of one source, drawn in a per-epoch shuffled order from a resumable cursor."""

    def __init__(self, name: str, rows: list[dict[str, Any]], seed: int, shuffle: bool) -> None:
        self.name = name
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.cursor = SourceCursor()
        self._order_epoch = -1
        self._order: list[int] = []

    def _order_for(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(f"{self.seed}:{self.name}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def take(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            order = self._order_for(self.cursor.epoch)
            idx = order[self.cursor.offset]
            row = self.rows[idx]
            out.append(Prompt(prompt_id=f"{self.name}/{idx}", source=self.name, prompt=row["prompt"],
                              label=row["label"], metadata=row["metadata"]))
            self.cursor.offset += 1
            if self.cursor.offset >= len(order):
                self.cursor = SourceCursor(epoch=self.cursor.epoch + 1, offset=0)
        return out


# --------------------------------------------------------------------------------------------
# The mixer
# --------------------------------------------------------------------------------------------


class DataMixer:
    """Draws each step's prompts from all sources in their weighted proportions (quota method)."""

    def __init__(self, job: JobConfig, components: Any) -> None:
        self.job = job
        self.streams = [SourceStream(src.name, load_rows(job, i, components), job.run.seed, src.shuffle)
                        for i, src in enumerate(job.data)]
        self.weights = [src.weight for src in job.data]
        self._int_weights = integer_weights(self.weights)
        self.drawn = [0] * len(self.streams)
        self.source_config = {src.name: src for src in job.data}

    def counts_for(self, n: int) -> list[int]:
        """How many of the next ``n`` prompts each source gives (advances the running quota)."""
        out = [0] * len(self.streams)
        for i in quota_sequence(self._int_weights, self.drawn, n):
            out[i] += 1
        return out

    def next_prompts(self, n: int) -> list[Prompt]:
        prompts: list[Prompt] = []
        for stream, count in zip(self.streams, self.counts_for(n)):
            prompts.extend(stream.take(count))
        return prompts

    def next_from(self, source: str) -> Prompt:
        """The next prompt of one source (the asynchronous loop draws by the scheduler's quotas)."""
        for i, stream in enumerate(self.streams):
            if stream.name == source:
                self.drawn[i] += 1
                return stream.take(1)[0]
        raise KeyError(f"no data source named {source!r}; sources: {', '.join(s.name for s in self.streams)}")

    @property
    def epoch_size(self) -> int:
        return sum(len(s.rows) for s in self.streams)

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": {s.name: c for s, c in zip(self.streams, self.drawn)},
                "cursors": {s.name: attrs.asdict(s.cursor) for s in self.streams}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore cursors and counts; a source missing from ``state`` starts at 0 (so does the
        quota of a state written before ``drawn`` was recorded)."""
        drawn = state.get("drawn", {})
        self.drawn = [int(drawn.get(s.name, 0)) for s in self.streams]
        for s in self.streams:
            if s.name in state["cursors"]:
                s.cursor = SourceCursor(**state["cursors"][s.name])
