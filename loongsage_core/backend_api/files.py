"""Per-step JSONL files of a run directory, cut back to a resumed step (atomically)."""

from __future__ import annotations

from ..controller.run_dir import truncate_jsonl

__all__ = ["truncate_jsonl"]
