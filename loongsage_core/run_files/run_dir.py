"""The run directory: refusing to mix two runs, moving an old one aside, resuming without losing
history.

A directory that already holds a run (``config.resolved.toml``, ``metrics.jsonl``,
``trained_prompts.jsonl``, ``rollouts/`` or ``checkpoints/``) is only

* continued, with ``run.resume = true``: from the newest intact checkpoint; the history files keep
  every step before it and only the steps that will be redone are dropped; or
* replaced, with ``--overwrite``: the old run is renamed to ``<dir>.old-<UTC time>`` beside it
  (nothing is deleted) and the run starts in an empty directory.

Anything else is refused before Ray starts, so rerunning a command by mistake loses nothing.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Sequence

from ..config import ConfigError
from . import checkpoint as ckpt

log = logging.getLogger("loongsage")

RUN_MARKERS: Sequence[str] = ("config.resolved.toml", "metrics.jsonl", "trained_prompts.jsonl", "rollouts",
                              "checkpoints")
"""Entries whose presence means a directory holds a run."""


def holds_run(out: Path) -> list[str]:
    """The run markers present in ``out`` (empty: no run there)."""
    return [name for name in RUN_MARKERS if (out / name).exists()]


def move_aside(out: Path) -> Path:
    """Rename ``out`` to a fresh ``<name>.old-<UTC time>`` beside it; returns the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = out.with_name(f"{out.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = out.with_name(f"{out.name}.old-{stamp}-{n}")
    out.rename(target)
    return target


def prepare_run_dir(out: Path, *, resume: bool, overwrite: bool, where: str) -> None:
    """Apply the rules of this module to ``out`` before a run starts (see the module docstring)."""
    if resume and overwrite:
        raise ConfigError(f"{where}: run.resume = true and --overwrite contradict each other: resume continues "
                          "the run in the directory, --overwrite moves it aside and starts fresh")
    markers = holds_run(out)
    if not markers:
        return
    if overwrite:
        moved = move_aside(out)
        out.mkdir(parents=True)
        log.warning("--overwrite: the previous run in %s was moved to %s", out, moved)
        return
    if not resume:
        raise ConfigError(f"{where}: run directory '{out}' already holds a run ({', '.join(markers)}); "
                          "continue it with run.resume=true, or start fresh with --overwrite (moves the old "
                          f"run to '{out.name}.old-<time>')")
    point, skipped = ckpt.find_resumable(out)
    history = (out / "metrics.jsonl").exists() or (out / "trained_prompts.jsonl").exists()
    if point is None and (skipped or history):
        detail = "; ".join(f"{d.name}: {reason}" for d, reason in skipped) or "no checkpoint was written"
        raise ConfigError(f"{where}: run.resume = true but run directory '{out}' has no intact checkpoint "
                          f"({detail}); starting over would overwrite its history: use --overwrite to move "
                          "it aside and start fresh")


def truncate_jsonl(path: Path, step: int) -> int:
    """Drop lines of a per-step JSONL file whose ``step`` is ``>= step`` (redone after a resume),
    and lines without a step or cut short by a kill; returns how many non-blank lines went.

    The file is rewritten atomically, so a kill meanwhile leaves either the old or the new one.
    """
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and int(record["step"]) < step
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            keep = False  # a line cut short by a kill
        if keep:
            kept.append(line)
        elif line.strip():
            dropped += 1
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
    tmp.replace(path)
    return dropped
