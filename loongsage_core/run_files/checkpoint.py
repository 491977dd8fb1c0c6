"""Checkpoint layout, the manifest that makes a checkpoint count, and the controller's state.

``<output>/checkpoints/step_<N>/`` holds ``trainer/`` (weights, optimizer, LR scheduler and each
rank's RNG state), ``critic_rank_<r>/`` when a critic is trained, ``controller.json`` (step,
weight version, data cursors and mixing quota) and, written last, ``manifest.json``: the size and
SHA-256 of every other file. The manifest is fsynced (with the files it lists and the directory)
before ``latest`` points at the checkpoint, so a checkpoint without a manifest that verifies is
one whose save did not finish or whose files changed since: resuming skips it, with a warning
naming it and why, and takes the newest intact one. Pruning keeps the newest ``keep`` intact
checkpoints and never deletes the newest intact one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import attrs

from ..errors import RunError

CONTROLLER_FILE = "controller.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")

log = logging.getLogger("loongsage")


class CheckpointError(RunError):
    """A checkpoint cannot be written or loaded; the message names the file or directory."""


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def step_dir(output_dir: Path, step: int) -> Path:
    return checkpoint_root(output_dir) / f"step_{step:06d}"


def trainer_dir(output_dir: Path, step: int) -> Path:
    """The trainer ranks' shared checkpoint directory (rank 0 writes the state, every rank its RNG)."""
    return step_dir(output_dir, step) / "trainer"


def step_dirs(output_dir: Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every checkpoint directory, newest first (intact or not)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def prepare_step_dir(output_dir: Path, step: int) -> Path:
    """An empty directory for the checkpoint of ``step``: leftovers of an unfinished save (or of
    a checkpoint past the one a run resumed from) are removed first, so no stale file mixes in."""
    d = step_dir(output_dir, step)
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


# --------------------------------------------------------------------------------------------
# Files: hashing, fsync
# --------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_and_sync(path: Path) -> tuple[int, str]:
    """Size and SHA-256 of ``path``; its data is fsynced on the way (it may come from another process)."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(fh.fileno())
    return size, digest.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file, fsync, rename, fsync the directory)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name != MANIFEST_FILE and not p.name.endswith(".tmp"))


def write_manifest(d: Path) -> dict[str, Any]:
    """Hash every file of checkpoint directory ``d`` and write ``manifest.json`` last, fsynced."""
    entries = {}
    for path in _files(d):
        try:
            size, sha = _hash_and_sync(path)
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint file '{path}': {exc.strerror or exc}") from None
        entries[path.relative_to(d).as_posix()] = {"size": size, "sha256": sha}
    for sub in sorted({p.parent for p in _files(d)}):
        _fsync_dir(sub)
    manifest = {"format": MANIFEST_FORMAT, "files": entries}
    _write_synced(d / MANIFEST_FILE, json.dumps(manifest, indent=1))
    return manifest


def verify(d: Path) -> str | None:
    """Why checkpoint directory ``d`` cannot be used (``None`` when its manifest verifies)."""
    manifest_path = d / MANIFEST_FILE
    if not manifest_path.is_file():
        return f"no {MANIFEST_FILE} (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"'{manifest_path}' is unreadable ({exc})"
    if CONTROLLER_FILE not in files:
        return f"{MANIFEST_FILE} does not list {CONTROLLER_FILE}"
    for rel, entry in files.items():
        path = d / rel
        if not path.is_file():
            return f"'{path}' is missing"
        size = path.stat().st_size
        if size != entry.get("size"):
            return f"'{path}' has {size} bytes, the manifest says {entry.get('size')}"
        try:
            _, sha = _hash_and_sync(path)
        except OSError as exc:
            return f"cannot read '{path}': {exc.strerror or exc}"
        if sha != entry.get("sha256"):
            return f"'{path}' does not match its SHA-256 in the manifest"
    return None


# --------------------------------------------------------------------------------------------
# Completing, finding, pruning
# --------------------------------------------------------------------------------------------


def write_controller_state(output_dir: Path, step: int, state: dict[str, Any], keep: int) -> None:
    """Complete the checkpoint of ``step``: ``controller.json``, then the manifest (both fsynced),
    then ``latest``; prune older intact checkpoints beyond the newest ``keep`` (0 keeps all)."""
    d = step_dir(output_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    _write_synced(d / CONTROLLER_FILE, json.dumps(state, indent=1))
    write_manifest(d)
    _write_synced(checkpoint_root(output_dir) / "latest", d.name)
    if keep > 0:
        prune(output_dir, keep, newest=step)


def prune(output_dir: Path, keep: int, newest: int) -> list[Path]:
    """Delete intact checkpoints older than the newest ``keep`` intact ones (the one of step
    ``newest``, just written and verified by its writer, always stays); returns what was deleted.

    Checkpoints that do not verify are left alone: they never count towards ``keep``, so they
    cannot push an intact one out.
    """
    kept = 0
    deleted = []
    for step, d in step_dirs(output_dir):
        if step > newest:
            continue
        intact = step == newest or (d / MANIFEST_FILE).is_file()
        if not intact:
            continue
        kept += 1
        if kept > keep and step != newest:
            shutil.rmtree(d, ignore_errors=True)
            deleted.append(d)
    return deleted


@attrs.define
class ResumePoint:
    """The checkpoint a run continues from, and those newer than it that were skipped (and why)."""

    step: int
    directory: Path
    state: dict[str, Any]
    skipped: list[tuple[Path, str]] = attrs.field(factory=list)


def read_point(d: Path, step: int) -> tuple[ResumePoint | None, str | None]:
    """Checkpoint directory ``d`` of ``step`` as a :class:`ResumePoint`, or why it cannot be used."""
    reason = verify(d)
    if reason is not None:
        return None, reason
    path = d / CONTROLLER_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        if int(state["step"]) != step:
            return None, f"'{path}' says step {state['step']}, its directory step {step}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"'{path}' is unreadable ({type(exc).__name__}: {exc})"
    return ResumePoint(step=step, directory=d, state=state), None


def find_resumable(output_dir: Path) -> tuple[ResumePoint | None, list[tuple[Path, str]]]:
    """The newest intact checkpoint (``None`` if there is none) and the newer ones skipped."""
    skipped: list[tuple[Path, str]] = []
    for step, d in step_dirs(output_dir):
        point, reason = read_point(d, step)
        if point is None:
            skipped.append((d, reason or "unusable"))
            continue
        point.skipped = list(skipped)
        return point, skipped
    return None, skipped


def warn_skipped(skipped: list[tuple[Path, str]], resumed: Path | None) -> None:
    """The loud warning of a resume that had to pass over broken checkpoints."""
    for d, reason in skipped:
        target = f"resuming from {resumed.name} instead" if resumed else "no intact checkpoint is left"
        log.warning("CHECKPOINT SKIPPED: %s cannot be used: %s; %s", d, reason, target)


def latest_checkpoint(output_dir: Path) -> tuple[int, dict[str, Any]] | None:
    """``(step, controller state)`` of the newest intact checkpoint, if any."""
    point, _ = find_resumable(output_dir)
    return (point.step, point.state) if point else None
