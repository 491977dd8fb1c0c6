"""Prompt data: loading sources, deterministic shuffling, multi-source mixing, resumable cursors.

Each ``[[data]]`` source yields rows ``{"prompt", "label", "metadata"}`` from a JSONL or parquet
file or from a procedural data source plugin. A source is consumed epoch by epoch in a shuffled
order fixed by ``(run seed, source name, epoch)``; its cursor is part of every checkpoint, so a
resumed run continues with exactly the prompts an uninterrupted run would have drawn.

Mixing: the number of prompts each source contributes to a step follows the largest-remainder
rule on ``weight * prompts_per_step`` with ties broken by source order, and the fractional parts
are carried to the next step (a running quota), so over any number of steps each source's count is
within one prompt of its exact share.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import attrs

from ..config import ConfigError, DataConfig, JobConfig


@attrs.define
class Prompt:
    """One prompt drawn for a step: a stable id, its source and the row's fields."""

    prompt_id: str
    source: str
    prompt: Any
    label: Any
    metadata: dict[str, Any]


def _read_jsonl(path: Path, where: str) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: {path}:{lineno}: invalid JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: {path}:{lineno}: each line must be a JSON object")
            rows.append(row)
    return rows


def _read_parquet(path: Path, where: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several error types for bad files
        raise ConfigError(f"{where}: cannot read parquet file {path}: {exc}") from None


def load_rows(job: JobConfig, index: int, components: Any) -> list[dict[str, Any]]:
    """All rows of data source ``index`` as ``{"prompt", "label", "metadata"}`` dicts."""
    src = job.data[index]
    where = f"{job.source_path or '<job>'}: data[{index}] ('{src.name}')"
    if src.generator:
        spec = components.get("data_source", src.generator, where=f"{where}.generator")
        args = {"seed": job.run.seed, **src.generator_args}
        try:
            raw = list(spec.factory(**args))
        except TypeError as exc:
            raise ConfigError(f"{where}.generator_args: {exc}") from None
    else:
        assert src.path is not None
        path = Path(job.resolve_path(src.path))
        if not path.exists():
            raise ConfigError(f"{where}.path: data file '{path}' does not exist")
        raw = _read_parquet(path, where) if path.suffix in (".parquet", ".pq") else _read_jsonl(path, where)
    rows = [_map_fields(r, src, f"{where} row {i}") for i, r in enumerate(raw)]
    if not rows:
        raise ConfigError(f"{where}: the data source is empty")
    return rows


def _map_fields(row: dict[str, Any], src: DataConfig, where: str) -> dict[str, Any]:
    if src.prompt_key not in row:
        raise ConfigError(f"{where}: missing prompt field '{src.prompt_key}' (set data.prompt_key); "
                          f"fields: {', '.join(sorted(row))}")
    if src.metadata_key:
        metadata = dict(row.get(src.metadata_key) or {})
    else:
        metadata = dict(row.get("metadata") or {})
        metadata.update({k: v for k, v in row.items() if k not in (src.prompt_key, src.label_key, "metadata")})
    return {"prompt": row[src.prompt_key], "label": row.get(src.label_key), "metadata": metadata}


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


def apportion(weights: list[float], total: int, carry: list[float]) -> tuple[list[int], list[float]]:
    """Split ``total`` items by ``weights`` (largest remainder, running quota).

    ``carry`` holds each source's fractional share owed from previous steps; returns the integer
    counts for this step and the new carry. Counts always sum to ``total``.
    """
    wsum = sum(weights)
    quotas = [total * w / wsum + c for w, c in zip(weights, carry)]
    counts = [int(q) for q in quotas]
    rest = total - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    new_carry = [q - c for q, c in zip(quotas, counts)]
    return counts, new_carry


class DataMixer:
    """Draws each step's prompts from all sources in their weighted proportions."""

    def __init__(self, job: JobConfig, components: Any) -> None:
        self.job = job
        self.streams = [SourceStream(src.name, load_rows(job, i, components), job.run.seed, src.shuffle)
                        for i, src in enumerate(job.data)]
        self.weights = [src.weight for src in job.data]
        self.carry = [0.0] * len(self.streams)
        self.source_config = {src.name: src for src in job.data}

    def next_prompts(self, n: int) -> list[Prompt]:
        counts, self.carry = apportion(self.weights, n, self.carry)
        prompts: list[Prompt] = []
        for stream, count in zip(self.streams, counts):
            prompts.extend(stream.take(count))
        return prompts

    @property
    def epoch_size(self) -> int:
        return sum(len(s.rows) for s in self.streams)

    def state_dict(self) -> dict[str, Any]:
        return {"carry": list(self.carry),
                "cursors": {s.name: attrs.asdict(s.cursor) for s in self.streams}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.carry = list(state["carry"])
        for s in self.streams:
            if s.name in state["cursors"]:
                s.cursor = SourceCursor(**state["cursors"][s.name])
