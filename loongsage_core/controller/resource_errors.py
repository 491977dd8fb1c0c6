"""A run that ran out of the machine, in one line saying what ran out, where, and what to change.

* **Disk** (``ENOSPC``, a quota, a file-size limit) anywhere the run writes: a checkpoint file of
  a trainer or critic rank, ``controller.json`` and the manifest, ``metrics.jsonl``. The line
  names the file and the free space of its file system, and the checkpoint that stays ``latest``:
  ``latest`` only moves once a checkpoint's manifest is written, so the last intact one is
  untouched and the run resumes from it once there is room. (Rollout records are written beside
  training and never stop it: :mod:`loongsage_core.records.writer` logs one line instead.)
* **Memory**: a model actor killed by Ray's memory monitor (``OutOfMemoryError``) or found dead
  for lack of memory.
* **Ray** that does not start or cannot be reached (:func:`ray_start_error`).
"""

from __future__ import annotations

from pathlib import Path

from ..disk_space import disk_full_error, free_space
from ..errors import RunError


class DiskFullError(RunError):
    """The run could not write a file for lack of room; the message names it and the free space."""


class OutOfMemoryRunError(RunError):
    """A model actor was killed for lack of memory; the message says what to change."""


class RayStartError(RunError):
    """The Ray cluster did not start, or could not be reached; the message says what to check."""


MEMORY_HINT = ("lower what one actor holds at once (train.micro_batch_size or "
               "train.max_tokens_per_micro_batch, rollout.max_new_tokens, rollout.prompts_per_step x "
               "samples_per_prompt), run fewer actors on the node (train.num_workers, rollout.num_engines, "
               "placement.colocate = true), or give the node more memory (Ray kills at "
               "RAY_memory_usage_threshold of it)")

OOM_MARKERS = ("outofmemoryerror", "running low on memory", "memory pressure", "oom killer", "oom kill")
"""How Ray says an actor or task was killed for memory (lower case)."""


def explain_resource_error(exc: BaseException, output_dir: Path) -> RunError | None:
    """``exc`` as a one-line :class:`DiskFullError` or :class:`OutOfMemoryRunError` when it is
    one of those (``None`` otherwise)."""
    full = disk_full_error(exc)
    if full is not None:
        return disk_full(full, output_dir)
    if is_out_of_memory(exc):
        return OutOfMemoryRunError(f"a model actor was killed for lack of memory: {memory_report(exc)}; "
                                   f"{MEMORY_HINT}")
    return None


def disk_full(error: OSError, output_dir: Path) -> DiskFullError:
    """The one line of a write that found no room."""
    from ..run_files import checkpoint as ckpt

    path = error.filename or str(output_dir)
    found = ckpt.latest_checkpoint(output_dir)
    kept = (f"the last intact checkpoint, step {found[0]}, stays 'latest': make room (or lower "
            "run.keep_checkpoints) and resume with run.resume=true" if found
            else "no checkpoint was completed before it")
    reason = (error.strerror or "no space left on device").lower()
    return DiskFullError(f"cannot write '{path}': {reason} ({free_space(path)}); {kept}")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` (or a cause of it) says Ray killed a worker for lack of memory."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = f"{type(current).__name__}: {current}".lower()
        if any(marker in text for marker in OOM_MARKERS):
            return True
        nxt = current.__cause__ or current.__context__ or getattr(current, "cause", None)
        current = nxt if isinstance(nxt, BaseException) else None
    return False


def memory_report(exc: BaseException) -> str:
    """Ray's own first line of the kill and its ``OOM kill reason``, if it gave one."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = next((line for line in lines if "memory" in line.lower()), lines[0] if lines else type(exc).__name__)
    reason = next((line for line in lines if line.lower().startswith("oom kill reason")), "")
    return f"{first} {reason}".strip()


def ray_start_error(exc: BaseException, address: str | None) -> RayStartError:
    """The one line of a Ray cluster that did not start (``address`` ``None``: the local one)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    if address:
        return RayStartError(f"cannot join the Ray cluster at '{address}' (run.ray_address or RAY_ADDRESS): "
                             f"{first}; start it there (`ray start --head`) or fix the address")
    return RayStartError(f"the local Ray cluster did not start: {type(exc).__name__}: {first}; the machine "
                         "may be short of memory or of room in /dev/shm and /tmp (lower run.ray_object_store_mb), "
                         "and Ray's own logs are in /tmp/ray/session_latest/logs")
