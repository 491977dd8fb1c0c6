"""Reading a ``[[data]]`` source's rows: files and data source plugins, checked row by row.

Each source yields rows ``{"prompt", "label", "metadata"}`` from a JSONL file (lines bounded by the
source's ``max_line_bytes``, JSON bounded before parsing), a parquet file, a directory written by
``datasets``' ``save_to_disk`` (one split of a saved ``DatasetDict`` is picked with ``split``) or
a procedural data source plugin (bound like every component the job names). Field errors name the
file and the row. ``loongsage validate``, the training run's data mixer, the held-out evaluation
and ``loongsage sft`` all read sources through this module, so they refuse the same rows.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Iterator, Mapping

import attrs

from loongsage_hookspecs import BuildContext

from . import safe_json
from .config import ConfigError, DataConfig, JobConfig, section_refs
from .config.rollout import DEFAULT_MAX_LINE_BYTES

__all__ = ["DATASET_MARKERS", "is_saved_dataset", "iter_rows", "load_rows", "map_fields", "read_jsonl_file",
           "read_source"]


DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files that mark a directory written by ``datasets``' ``save_to_disk``."""


def read_jsonl_file(path: Path, where: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                    ) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(location, row)`` of each non-blank line of a JSONL file; undecodable text, invalid JSON,
    a non-object line or a line longer than ``max_line_bytes`` is a :class:`ConfigError` naming
    the file and line. Lines are read with a bounded ``readline``, so a line too long is refused
    having held at most ``max_line_bytes + 1`` bytes of it."""
    with path.open("rb") as fh:
        for lineno in itertools.count(1):
            raw_line = fh.readline(max_line_bytes + 1)
            if not raw_line:
                return
            loc = f"{path}:{lineno}"
            if len(raw_line) > max_line_bytes and not raw_line.endswith(b"\n"):
                raise ConfigError(f"{where}: {loc}: the line is longer than max_line_bytes ({max_line_bytes} "
                                  "bytes); shorten the row or raise the source's max_line_bytes")
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{where}: {loc}: not UTF-8 text (byte {exc.start} of the line: "
                                  f"{exc.reason}); data files are UTF-8") from None
            if not line.strip():
                continue
            try:
                row = safe_json.loads(line)  # bounded: a row nested 100k deep is an error, not a RecursionError
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: {loc}: invalid JSON: {exc.msg}") from None
            except ValueError as exc:
                raise ConfigError(f"{where}: {loc}: {exc}") from None
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
    return list(iter_rows(job, index, components))


def iter_rows(job: JobConfig, index: int, components: Any) -> Iterator[dict[str, Any]]:
    """The rows of :func:`load_rows` one at a time (``loongsage validate`` reads every row of a
    data file this way without keeping them); an empty source is a :class:`ConfigError` once the
    end is reached."""
    src = job.data[index]
    where = job.data_where(index)
    count = 0
    for loc, row in read_source(job, index, components):
        count += 1
        yield map_fields(row, src, f"{where}: {loc}")
    if not count:
        raise ConfigError(f"{where}: the data source is empty")


def read_source(job: JobConfig, index: int, components: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(location, raw row)`` of every row of data source ``index``, as stored (no field mapping):
    a file's rows (JSONL, parquet, a saved ``datasets`` directory) or a data source plugin's."""
    src = job.data[index]
    where = job.data_where(index)
    raw: Iterator[tuple[str, dict[str, Any]]]
    if src.generator:
        (ref,) = [r for r in section_refs(src, f"data[{index}]", job) if r.kind == "data_source"]
        ctx = BuildContext(where=ref.where, job=job, components=components)
        # the run's seed, unless the job gives the generator its own
        produced = list(components.bind(attrs.evolve(ref, args={"seed": job.run.seed, **ref.args}), ctx))
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
            raw = (_read_parquet(path, where) if path.suffix in (".parquet", ".pq")
                   else read_jsonl_file(path, where, src.max_line_bytes))
    return raw


def _check_prompt(value: Any, src: DataConfig, where: str) -> None:
    """A prompt is a non-blank string or a non-empty list of chat messages, and its text is valid
    Unicode: a lone UTF-16 surrogate (``"\\ud800"`` in JSON) decodes into a Python string that
    no tokenizer can encode."""
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{where}: prompt field '{src.prompt_key}' is empty: a blank prompt gives the "
                              "policy nothing to answer; remove the row")
    elif not (isinstance(value, list) and value and all(isinstance(m, Mapping) and "role" in m for m in value)):
        raise ConfigError(f"{where}: field '{src.prompt_key}' must be a string or a non-empty list of chat "
                          f"messages (objects with a 'role'), got {type(value).__name__} {_short(value)}")
    for text in _strings(value):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"{where}: prompt field '{src.prompt_key}' holds a lone UTF-16 surrogate "
                              f"{text[exc.start]!r} at character {exc.start}: not valid Unicode text, which "
                              "no tokenizer can encode") from None


def _strings(value: Any) -> Iterator[str]:
    """Every string inside ``value`` (nested lists and mappings, keys included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


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
