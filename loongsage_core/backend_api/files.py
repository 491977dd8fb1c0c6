"""Per-step JSONL files of a run directory, cut back to a resumed step (atomically), and checkpoint
files written atomically, a full disk raised as an ``OSError`` naming the file."""

from __future__ import annotations

from ..disk_space import save_torch_atomically
from ..run_files.run_dir import truncate_jsonl

__all__ = ["save_torch_atomically", "truncate_jsonl"]
