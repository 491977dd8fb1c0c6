"""The ``jsonl`` logger: one JSON object per step appended to ``<output_dir>/metrics.jsonl``.

Each line is ``{"step": step, "<metric>": value, ...}``, written and flushed as soon as the step
is logged, so the file can be followed while a run goes on and survives a crash. Non-finite
floats (NaN, infinities) are written as ``null`` to keep every line valid JSON. On resume the
file is appended to; :meth:`JsonlLogger.truncate_after` first drops the lines of steps that the
resumed run will redo.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # pragma: no cover - typing only
    from loongsage_hookspecs import LoggerContext

from loongsage_core.backend_api.files import truncate_jsonl

DEFAULT_FILENAME = "metrics.jsonl"


def _jsonable(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item"):  # 0-d tensors and numpy scalars
        return _jsonable(value.item())
    try:
        return _jsonable(float(value))
    except (TypeError, ValueError):
        return str(value)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file, in file order; unreadable lines are skipped."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if isinstance(record, dict):
                records.append(record)
    return records


class JsonlLogger:
    """Appends each step's metrics to ``<output_dir>/<filename>`` as one JSON line.

    Args:
        ctx: the logger's context; the file goes to ``ctx.output_dir`` (created if missing).
        filename: file name inside ``output_dir``.
        truncate_on_resume: whether :meth:`truncate_after` (called by the host when a run
            resumes) drops the lines of steps at or after the resumed step; when false the old
            lines stay and the redone steps appear twice.
    """

    def __init__(self, ctx: "LoggerContext", *, filename: str = DEFAULT_FILENAME,
                 truncate_on_resume: bool = True) -> None:
        if not filename or Path(filename).name != filename:
            raise ValueError(f"jsonl logger: 'filename' must be a plain file name, got {filename!r}")
        self.path = Path(ctx.output_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.truncate_on_resume = bool(truncate_on_resume)
        self._fh = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append ``{"step": step, **metrics}`` as one line and flush it."""
        if self._fh.closed:
            raise RuntimeError(f"jsonl logger: log() after close() ({self.path})")
        record: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            if key != "step":
                record[str(key)] = _jsonable(value)
        self._fh.write(json.dumps(record, allow_nan=False) + "\n")
        self._fh.flush()

    def truncate_after(self, step: int) -> int:
        """Drop the lines whose ``step`` is ``>= step`` (and any line cut short); returns how many.

        Does nothing (and returns 0) when the logger was built with ``truncate_on_resume=False``.
        """
        if not self.truncate_on_resume:
            return 0
        self._fh.close()
        dropped = truncate_jsonl(self.path, step)
        self._fh = open(self.path, "a", encoding="utf-8")
        return dropped

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
