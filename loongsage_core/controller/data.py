"""Prompt data: loading sources, deterministic shuffling, multi-source mixing, resumable cursors.

Each ``[[data]]`` source yields rows ``{"prompt", "label", "metadata"}`` from a JSONL file, a
parquet file, a directory written by ``datasets``' ``save_to_disk`` (one split of a saved
``DatasetDict`` is picked with ``split``) or a procedural data source plugin. A source is consumed
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
* Inside a step (:func:`interleave_by_source`): the step's rows are ordered so that every
  mini-batch, and every data-parallel shard of a mini-batch, holds each source's share of its
  parent rounded down or up (``floor`` or ``ceil`` of ``size * rows_of_source / rows``), with the
  counts of every source adding up exactly to what the parent holds.
"""

from __future__ import annotations

import json
import math
import random
from collections import deque
from fractions import Fraction
from pathlib import Path
from typing import Any, Hashable, Iterator, Mapping, Sequence

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


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files that mark a directory written by ``datasets``' ``save_to_disk``."""


def read_jsonl_file(path: Path, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(location, row)`` of each non-blank line of a JSONL file; undecodable text, invalid JSON
    or a non-object line is a :class:`ConfigError` naming the file and line."""
    with path.open("rb") as fh:
        for lineno, raw_line in enumerate(fh, 1):
            loc = f"{path}:{lineno}"
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{where}: {loc}: not UTF-8 text (byte {exc.start} of the line: "
                                  f"{exc.reason}); data files are UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: {loc}: invalid JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: {loc}: each line must be a JSON object")
            yield loc, row


def _read_parquet(path: Path, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several error types for bad files
        raise ConfigError(f"{where}: cannot read parquet file {path}: {exc}") from None
    for i, row in enumerate(rows):
        yield f"{path} row {i}", row


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return path.is_dir() and any((path / marker).is_file() for marker in DATASET_MARKERS)


def _read_saved_dataset(path: Path, split: str | None, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises several error types for damaged directories
        raise ConfigError(f"{where}: cannot load the dataset saved in {path}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split is None:
            if len(splits) != 1:
                raise ConfigError(f"{where}.split: {path} holds the splits {splits}; set 'split' to pick one")
            split = splits[0]
        if split not in loaded:
            raise ConfigError(f"{where}.split: no split '{split}' in {path}; splits: {', '.join(splits)}")
        table, label = loaded[split], f"{path} [{split}]"
    else:
        if split is not None:
            raise ConfigError(f"{where}.split: '{split}' given, but {path} holds a single dataset, not a "
                              "DatasetDict; remove 'split'")
        table, label = loaded, str(path)
    for i, row in enumerate(table.to_list()):
        yield f"{label} row {i}", row


def load_rows(job: JobConfig, index: int, components: Any) -> list[dict[str, Any]]:
    """All rows of data source ``index`` as ``{"prompt", "label", "metadata"}`` dicts.

    Field errors name the file and the row (the line for JSONL, the 0-based row otherwise).
    """
    src = job.data[index]
    where = f"{job.source_path or '<job>'}: data[{index}] ('{src.name}')"
    raw: Iterator[tuple[str, dict[str, Any]]]
    if src.generator:
        spec = components.get("data_source", src.generator, where=f"{where}.generator")
        args = {"seed": job.run.seed, **src.generator_args}
        try:
            produced = list(spec.factory(**args))
        except TypeError as exc:
            raise ConfigError(f"{where}.generator_args: {exc}") from None
        raw = ((f"generator '{src.generator}' row {i}", r) for i, r in enumerate(produced))
    else:
        assert src.path is not None
        path = Path(job.resolve_path(src.path))
        if not path.exists():
            raise ConfigError(f"{where}.path: data file '{path}' does not exist")
        if path.is_dir():
            if not is_saved_dataset(path):
                raise ConfigError(f"{where}.path: '{path}' is a directory but not a dataset saved with "
                                  f"save_to_disk (none of {', '.join(DATASET_MARKERS)} in it)")
            raw = _read_saved_dataset(path, src.split, where)
        else:
            if src.split is not None:
                raise ConfigError(f"{where}.split: only a saved DatasetDict directory has splits; "
                                  f"'{path}' is a file")
            raw = _read_parquet(path, where) if path.suffix in (".parquet", ".pq") else read_jsonl_file(path, where)
    rows = [map_fields(r, src, f"{where}: {loc}") for loc, r in raw]
    if not rows:
        raise ConfigError(f"{where}: the data source is empty")
    return rows


def _check_prompt(value: Any, src: DataConfig, where: str) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and value and all(isinstance(m, Mapping) and "role" in m for m in value):
        return
    raise ConfigError(f"{where}: field '{src.prompt_key}' must be a string or a non-empty list of chat "
                      f"messages (objects with a 'role'), got {type(value).__name__} {_short(value)}")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def map_fields(row: Mapping[str, Any], src: DataConfig, where: str) -> dict[str, Any]:
    """One raw row as ``{"prompt", "label", "metadata"}`` by the source's field mapping.

    ``prompt_key`` must be present (a string or chat messages); ``label_key`` may be absent (the
    label is then ``None``). With ``metadata_key`` set, that field (an object, or null for none)
    is the metadata; without it, every field other than the prompt and the label is, with the
    contents of a ``metadata`` object merged in. ``where`` names the file and row in errors.
    """
    if not isinstance(row, Mapping):
        raise ConfigError(f"{where}: a row must be an object with named fields, got {type(row).__name__}")
    if src.prompt_key not in row or row[src.prompt_key] is None:
        state = "is null" if src.prompt_key in row else "is missing"
        raise ConfigError(f"{where}: prompt field '{src.prompt_key}' {state} (set data.prompt_key); "
                          f"fields: {', '.join(sorted(map(str, row)))}")
    _check_prompt(row[src.prompt_key], src, where)
    if src.metadata_key:
        if src.metadata_key not in row:
            raise ConfigError(f"{where}: metadata field '{src.metadata_key}' is missing (data.metadata_key); "
                              f"fields: {', '.join(sorted(map(str, row)))}")
        value = row[src.metadata_key]
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"{where}: metadata field '{src.metadata_key}' must be an object, got "
                              f"{type(value).__name__} {_short(value)}")
        metadata = dict(value or {})
    else:
        nested = row.get("metadata")
        metadata = dict(nested) if isinstance(nested, Mapping) else {}
        skip = {src.prompt_key, src.label_key} | ({"metadata"} if isinstance(nested, Mapping) else set())
        metadata.update({k: v for k, v in row.items() if k not in skip})
    return {"prompt": row[src.prompt_key], "label": row.get(src.label_key), "metadata": metadata}


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
# Rounding rules
# --------------------------------------------------------------------------------------------


def integer_weights(weights: Sequence[float | int]) -> list[int]:
    """``weights`` scaled to integers with the same ratios, exactly.

    Each float is read as the decimal it prints as (``0.3`` is 3/10, not the nearest binary
    fraction), so decimal weights from a job file give the shares they say.
    """
    exact: list[Fraction] = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"weight {i} must be a finite number >= 0, got {w!r}")
        exact.append(Fraction(repr(w)) if isinstance(w, float) else Fraction(w))
    if not any(exact):
        raise ValueError(f"at least one weight must be > 0, got {list(weights)}")
    scale = math.lcm(*(f.denominator for f in exact))
    return [int(f * scale) for f in exact]


def quota_sequence(weights: Sequence[int], counts: list[int], n: int) -> list[int]:
    """Hand out ``n`` more items one at a time by the quota method; return who got each.

    ``weights`` are non-negative integers (:func:`integer_weights`); ``counts`` holds the items
    each source has received so far and is updated in place. Item ``h`` (counting every item ever
    handed out) goes to the source with the largest ``weight / (count + 1)`` among those with
    ``count < h * weight / sum(weights)`` (ties: the earlier source). Every source's count then
    stays within ``floor`` and ``ceil`` of its exact share of ``h`` after every item
    (Balinski and Young's quota method: it satisfies quota and never takes an item back).
    """
    total_w = sum(weights)
    if total_w <= 0:
        raise ValueError(f"quota_sequence: weights must not all be 0, got {list(weights)}")
    if len(counts) != len(weights):
        raise ValueError(f"quota_sequence: {len(counts)} counts for {len(weights)} weights")
    h = sum(counts)
    out: list[int] = []
    for _ in range(n):
        h += 1
        best = -1
        for i, w in enumerate(weights):
            if counts[i] * total_w < h * w and (best < 0 or w * (counts[best] + 1) > weights[best] * (counts[i] + 1)):
                best = i
        # some source is always eligible: sum(counts) * total_w = (h - 1) * total_w < h * sum(weights)
        counts[best] += 1
        out.append(best)
    return out


def round_shares(totals: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Split each source's ``totals[s]`` items over blocks of ``sizes[k]`` items.

    Returns ``counts[k][s]``: each entry is ``floor`` or ``ceil`` of the exact share
    ``sizes[k] * totals[s] / sum(totals)``, every block ``k`` holds exactly ``sizes[k]`` items and
    every source exactly ``totals[s]``. Such a rounding always exists (the exact shares are a
    fractional flow with whole row and column sums, so an integral flow of the same value does);
    which blocks get the rounded-up entries is found by augmenting paths over the fractional
    cells, larger fractional parts tried first.
    """
    n = sum(totals)
    if sum(sizes) != n:
        raise ValueError(f"round_shares: block sizes add up to {sum(sizes)}, the totals to {n}")
    if any(t < 0 for t in totals) or any(s < 0 for s in sizes):
        raise ValueError(f"round_shares: negative entry in totals {list(totals)} or sizes {list(sizes)}")
    K, S = len(sizes), len(totals)
    if n == 0:
        return [[0] * S for _ in range(K)]
    base = [[sizes[k] * totals[s] // n for s in range(S)] for k in range(K)]
    rem = [[sizes[k] * totals[s] % n for s in range(S)] for k in range(K)]
    row_need = [sizes[k] - sum(base[k]) for k in range(K)]
    col_need = [totals[s] - sum(base[k][s] for k in range(K)) for s in range(S)]
    cells = [sorted((s for s in range(S) if rem[k][s]), key=lambda s: (-rem[k][s], s)) for k in range(K)]
    up = [[False] * S for _ in range(K)]
    for k in range(K):
        for _ in range(row_need[k]):
            if not _augment(k, cells, up, col_need):
                raise RuntimeError(f"round_shares: no rounding found for totals {list(totals)} and sizes "
                                   f"{list(sizes)}")
    return [[base[k][s] + int(up[k][s]) for s in range(S)] for k in range(K)]


def _augment(start: int, cells: list[list[int]], up: list[list[bool]], col_need: list[int]) -> bool:
    """One more rounded-up cell in block ``start``: an alternating path to a source still short."""
    K = len(cells)
    seen_rows = {start}
    parent: dict[tuple[str, int], tuple[str, int]] = {}
    queue = deque([start])
    while queue:
        k = queue.popleft()
        for s in cells[k]:
            if up[k][s] or ("col", s) in parent:
                continue
            parent[("col", s)] = ("row", k)
            if col_need[s] > 0:
                col_need[s] -= 1
                node: tuple[str, int] = ("col", s)
                while node in parent:  # flip the path: row->col cells go up, col->row cells go back down
                    kind, idx = parent[node]
                    if node[0] == "col":
                        up[idx][node[1]] = True
                    else:
                        up[node[1]][idx] = False
                    node = (kind, idx)
                return True
            for k2 in range(K):
                if up[k2][s] and k2 not in seen_rows:
                    seen_rows.add(k2)
                    parent[("row", k2)] = ("col", s)
                    queue.append(k2)
    return False


def interleave_by_source(sources: Sequence[Hashable], mini_batch_size: int, world_size: int = 1, *,
                         seed: Any = None) -> list[int]:
    """An order of a step's rows that gives every mini-batch and every rank its share of each source.

    ``sources[i]`` is row ``i``'s data source (``batch.meta["source"]``). The returned permutation
    is meant to be cut as the trainer cuts it: mini-batch ``j`` is ``order[j * mini_batch_size:
    (j + 1) * mini_batch_size]`` (the last one may be smaller) and its rank ``r`` gets the
    contiguous range ``batching.shard_rows(len(mini_batch), world_size)[r]`` of it (``world_size``:
    the data-parallel ranks; tensor and pipeline parallel peers share their replica's rows).

    Rounding rule (:func:`round_shares`, applied twice): mini-batch ``j`` of ``m_j`` rows holds
    ``floor`` or ``ceil`` of ``m_j * n_s / N`` rows of source ``s`` (``n_s`` of the step's ``N``
    rows), the counts of every source over all mini-batches adding up to ``n_s`` exactly; a rank's
    shard of ``w`` rows of that mini-batch holds ``floor`` or ``ceil`` of ``w * c_s / m_j`` of its
    ``c_s`` rows of ``s``, the shards adding up to ``c_s`` exactly. Inside a shard the sources
    are interleaved by :func:`quota_sequence`, so micro-batches are mixed too. Which rows of a
    source go where is random, from ``seed`` (any value ``random.Random`` accepts).
    """
    from .batching import shard_rows

    if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1:
        raise ValueError(f"interleave_by_source: mini_batch_size must be an integer >= 1, got {mini_batch_size!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"interleave_by_source: world_size must be an integer >= 1, got {world_size!r}")
    labels: list[Hashable] = []
    pools: dict[Hashable, list[int]] = {}
    for i, src in enumerate(sources):
        if src not in pools:
            pools[src] = []
            labels.append(src)
        pools[src].append(i)
    rng = random.Random(seed)
    for rows in pools.values():
        rng.shuffle(rows)
    n = len(sources)
    totals = [len(pools[s]) for s in labels]
    sizes = [min(mini_batch_size, n - start) for start in range(0, n, mini_batch_size)]
    cursor = {s: 0 for s in labels}
    order: list[int] = []
    for size, mini_counts in zip(sizes, round_shares(totals, sizes)):
        shard_sizes = [len(r) for r in shard_rows(size, world_size)]
        for shard_counts in round_shares(mini_counts, shard_sizes):
            if not any(shard_counts):
                continue
            for s_idx in quota_sequence(shard_counts, [0] * len(labels), sum(shard_counts)):
                src = labels[s_idx]
                order.append(pools[src][cursor[src]])
                cursor[src] += 1
    return order


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
