"""What the run viewer reads from a run directory: metrics, record steps, records.

Everything here copes with a run that is still being written: a ``metrics.jsonl`` line cut short
is skipped, a step whose records are not on disk yet is simply absent, and a records file that
cannot be read whole is shown as far as it goes, with the problem said in one line.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import NotARunError
from ..records import ROLLOUTS_DIR, read_rollouts_partial, rollout_steps
from ..records.format import records_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.resolved.toml"


def check_run_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a run directory, or :class:`NotARunError` naming it and what is missing."""
    p = Path(path)
    if not p.exists():
        raise NotARunError(f"{p}: no such directory")
    if not p.is_dir():
        raise NotARunError(f"{p}: not a directory")
    if not any((p / name).exists() for name in (METRICS_FILE, ROLLOUTS_DIR, CONFIG_FILE)):
        raise NotARunError(f"{p}: not a LoongSage run directory (no {METRICS_FILE}, {ROLLOUTS_DIR}/ or {CONFIG_FILE})")
    return p


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunDir:
    """One run directory, read again whenever it changed (so a live run is followed)."""

    def __init__(self, path: str | os.PathLike[str], name: str | None = None) -> None:
        self.path = check_run_dir(path)
        self.name = name or self.path.resolve().name
        self._metrics: list[dict[str, Any]] = []
        self._metrics_key: tuple[int, int] | None = None
        self._records: dict[int, tuple[tuple[int, int], list[dict[str, Any]], str | None]] = {}

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> list[dict[str, Any]]:
        """Every complete line of ``metrics.jsonl`` (one per step), re-read when the file changed."""
        path = self.path / METRICS_FILE
        try:
            st = path.stat()
        except FileNotFoundError:
            return []
        key = (st.st_mtime_ns, st.st_size)
        if key != self._metrics_key:
            rows = []
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    if not line.endswith("\n"):
                        break  # the line being written
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(row, dict) and isinstance(row.get("step"), int):
                        rows.append({k: _finite(v) for k, v in row.items()})
            self._metrics, self._metrics_key = rows, key
        return self._metrics

    def total_steps(self) -> int | None:
        """``train.total_steps`` of the run's resolved job file, when it is there."""
        try:
            job = tomllib.loads((self.path / CONFIG_FILE).read_text(encoding="utf-8"))
            value = job.get("train", {}).get("total_steps")
            return int(value) if value is not None else None
        except (OSError, tomllib.TOMLDecodeError, TypeError, ValueError):
            return None

    def summary(self, index: int) -> dict[str, Any]:
        metrics = self.metrics()
        total = self.total_steps()
        done = metrics[-1]["step"] + 1 if metrics else 0
        finished = (self.path / "final_hf").exists() or (total is not None and done >= total)
        return {"id": index, "name": self.name, "path": str(self.path), "metrics_steps": len(metrics),
                "total_steps": total, "record_steps": rollout_steps(self.path), "finished": finished}

    # ------------------------------------------------------------------ records

    def records(self, step: int) -> tuple[list[dict[str, Any]], str | None]:
        """``(records, problem)`` of ``step``, cached until the file changes."""
        path = records_path(self.path, step)
        st = path.stat()  # FileNotFoundError: the caller answers 404
        key = (st.st_mtime_ns, st.st_size)
        cached = self._records.get(step)
        if cached is None or cached[0] != key:
            records, problem = read_rollouts_partial(self.path, step)
            cached = (key, records, problem)
            self._records[step] = cached
            if len(self._records) > 8:  # keep memory bounded on long runs
                self._records.pop(next(iter(self._records)))
        return cached[1], cached[2]


def trajectory_row(record: dict[str, Any]) -> dict[str, Any]:
    """The columns of a step's trajectory table (the full record is fetched on demand)."""
    reward = record.get("reward") or {}
    text = record.get("response_text") or ""
    if not text and record.get("turns"):  # an agent that ended on a tool call: its last words
        text = record["turns"][-1].get("response_text") or ""
    return {
        "index": record.get("index"), "id": record.get("id"), "source": record.get("source"),
        "agent": record.get("agent"), "status": record.get("status"), "error": record.get("error"),
        "reward": reward.get("score"), "reason": reward.get("reason") or reward.get("error") or "",
        "response_length": record.get("response_length"), "turns": len(record.get("turns") or []),
        "tool_calls": len(record.get("tool_calls") or []), "staleness": record.get("staleness"),
        "trained": record.get("trained"), "filtered": bool(record.get("filtered")), "response_text": text[:200],
    }
