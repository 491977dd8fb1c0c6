"""Checkpoint layout and the controller's own resumable state.

``<output>/checkpoints/step_<N>/`` holds ``trainer/`` (weights, optimizer, LR scheduler and each
rank's RNG state), ``critic_rank_<r>/`` when a critic is trained, and ``controller.json``
(step, weight version, data cursors and mixing quota).
A checkpoint counts only once ``controller.json`` is written last, and ``latest`` names it, so
a run killed mid-save resumes from the previous complete one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

CONTROLLER_FILE = "controller.json"


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def step_dir(output_dir: Path, step: int) -> Path:
    return checkpoint_root(output_dir) / f"step_{step:06d}"


def trainer_dir(output_dir: Path, step: int) -> Path:
    """The trainer ranks' shared checkpoint directory (rank 0 writes the state, every rank its RNG)."""
    return step_dir(output_dir, step) / "trainer"


def write_controller_state(output_dir: Path, step: int, state: dict[str, Any], keep: int) -> None:
    """Write the controller state (completing the checkpoint), point ``latest`` at it, prune old ones."""
    d = step_dir(output_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (CONTROLLER_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, d / CONTROLLER_FILE)
    latest = checkpoint_root(output_dir) / "latest"
    tmp_latest = latest.with_suffix(".tmp")
    tmp_latest.write_text(d.name)
    os.replace(tmp_latest, latest)
    if keep > 0:
        complete = sorted(p for p in checkpoint_root(output_dir).glob("step_*") if (p / CONTROLLER_FILE).exists())
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(output_dir: Path) -> tuple[int, dict[str, Any]] | None:
    """``(step, controller state)`` of the newest complete checkpoint, if any."""
    root = checkpoint_root(output_dir)
    candidates = sorted((p for p in root.glob("step_*") if (p / CONTROLLER_FILE).exists()), reverse=True)
    for d in candidates:
        try:
            state = json.loads((d / CONTROLLER_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        return int(state["step"]), state
    return None
