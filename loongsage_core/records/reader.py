"""Reading rollout records back: the stable, public way (``loongsage_core.read_rollouts``).

Files are written whole and renamed into place, so a complete run never holds a partial file;
a file cut short anyway (a full disk, a copy interrupted) is an error naming the file in
:func:`read_rollouts`, and :func:`read_rollouts_partial` returns the records before the cut for
tools that would rather show them (the run viewer).
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

from .format import FORMAT_VERSION, ROLLOUTS_DIR, records_path, step_of


class RolloutRecordsError(ValueError):
    """A records file that cannot be read as rollout records; the message names the file."""


def rollout_steps(run_dir: str | Path) -> list[int]:
    """The steps of ``run_dir`` that have a records file, ascending (empty when none do)."""
    folder = Path(run_dir) / ROLLOUTS_DIR
    if not folder.is_dir():
        return []
    return sorted(s for s in (step_of(p) for p in folder.iterdir()) if s is not None)


def read_rollouts_partial(run_dir: str | Path, step: int) -> tuple[list[dict[str, Any]], str | None]:
    """``(records, problem)``: the records of ``step`` that could be read, and ``None`` or a one-line
    description of why the rest could not (truncated or corrupt file, a newer format)."""
    path = records_path(run_dir, step)
    if not path.is_file():
        raise RolloutRecordsError(f"{path}: no rollout records for step {step} (steps with records: "
                                  f"{_describe(rollout_steps(run_dir))})")
    records: list[dict[str, Any]] = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    return records, f"{path}: line {lineno} is not JSON ({exc.msg})"
                if not isinstance(record, dict):
                    return records, f"{path}: line {lineno} is not a JSON object"
                version = record.get("format")
                if not isinstance(version, int) or version > FORMAT_VERSION:
                    return records, (f"{path}: line {lineno} has record format {version!r}; this version of "
                                     f"LoongSage reads format {FORMAT_VERSION} and older")
                records.append(record)
    except EOFError:
        return records, f"{path}: truncated after {len(records)} records (the file was cut short)"
    except (OSError, zlib.error, UnicodeDecodeError) as exc:
        return records, f"{path}: not a readable gzip file after {len(records)} records ({exc})"
    return records, None


def read_rollouts(run_dir: str | Path, step: int) -> list[dict[str, Any]]:
    """The rollout records of ``step`` in ``run_dir`` (one dict per trajectory, docs/reference/records.md).

    Raises :class:`RolloutRecordsError` naming the file when it is missing, truncated or corrupt.
    """
    records, problem = read_rollouts_partial(run_dir, step)
    if problem is not None:
        raise RolloutRecordsError(problem)
    return records


def _describe(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
    return ", ".join(map(str, steps[:20])) + (" ..." if len(steps) > 20 else "")
