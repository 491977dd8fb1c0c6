"""The rollout records writer: a thread that turns each step's trajectories into a records file.

The training loop only hands over references (:meth:`RolloutRecorder.add`); building the records
(tensors to lists, token text) and compressing them happen on the writer thread. Each file is
written to a temporary name and renamed into place, so a killed run leaves whole files or none.

A file that cannot be written for lack of room is one logged line naming it and the free space
(its temporary file removed); training goes on.

Resume keeps records and ``metrics.jsonl`` aligned: :meth:`RolloutRecorder.truncate_after` drops the
files of the steps the resumed run redoes, and :meth:`RolloutRecorder.flush` (called before a
checkpoint completes) makes sure every step before the checkpoint is on disk.
"""

from __future__ import annotations

import gzip
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from loongsage_hookspecs import TrajectoryLogger

from ..disk_space import disk_full_error, free_space
from .format import ROLLOUTS_DIR, build_records, dumps, records_path, step_of

log = logging.getLogger("loongsage")

Listener = Callable[[int, list[dict[str, Any]]], None]
"""Called on the writer thread with each step's records (e.g. a logger's ``log_trajectories``)."""


class TokenText:
    """Each token id's own text, decoded once per id and cached (for the viewer's token view)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def pieces(self, ids: list[int]) -> list[str]:
        missing = [i for i in set(ids) if i not in self.cache]
        if missing:
            texts = self.tokenizer.batch_decode([[i] for i in missing], skip_special_tokens=False)
            self.cache.update(zip(missing, texts))
        return [self.cache[i] for i in ids]

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False)) if ids else ""


class RolloutRecorder:
    """Writes ``<output_dir>/rollouts/step_NNNNNN.jsonl.gz`` for each step, off the training loop.

    Args:
        output_dir: the run directory.
        tokenizer: the policy tokenizer (token text and per-turn text).
        keep: trajectories kept per step: ``-1`` all, ``0`` none (no files are written; listeners
            still receive records), ``N`` a seeded sample of N.
        agents: data source name -> agent name, recorded with each trajectory.
        seed: the run's seed (the sample of ``keep`` trajectories depends on it and the step).
        listeners: called with ``(step, records)`` after each step is built.
    """

    def __init__(self, output_dir: str | Path, tokenizer: Any, *, keep: int = -1,
                 agents: Mapping[str, str] | None = None, seed: Any = 0,
                 listeners: Sequence[Listener] = ()) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < -1:
            raise ValueError(f"run.rollout_records must be -1 (all), 0 (off) or a positive count, got {keep!r}")
        self.dir = Path(output_dir) / ROLLOUTS_DIR
        self.text = TokenText(tokenizer)
        self.keep = keep
        self.agents = dict(agents or {})
        self.seed = seed
        self.listeners = list(listeners)
        self.errors = 0
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """Whether anything is recorded: files are kept or someone listens."""
        return self.keep != 0 or bool(self.listeners)

    def truncate_after(self, step: int) -> list[int]:
        """Delete the records of steps ``>= step`` (and half-written files); returns the deleted steps."""
        dropped = []
        if self.dir.is_dir():
            for path in self.dir.iterdir():
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)
                    continue
                s = step_of(path)
                if s is not None and s >= step:
                    path.unlink(missing_ok=True)
                    dropped.append(s)
        return sorted(dropped)

    def add(self, step: int, groups: Sequence[Any], batch: Any, policy_version: int,
            filtered: Sequence[Any] = (), evaluated: Sequence[Any] = ()) -> None:
        """Queue ``step``'s trajectory groups with the batch that trained them (returns at once);
        ``filtered``: every group the step sampled; the trajectories a filter dropped from them are
        recorded after the others (those also in ``groups`` are recorded once); ``evaluated``: the
        held-out evaluation's groups of the step, recorded last, marked as such.

        Neither the groups nor ``batch`` may change afterwards (the loop builds new ones per step).
        """
        if not self.active:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="rollout-records", daemon=True)
            self._thread.start()
        self._queue.put((step, list(groups), batch, policy_version, list(filtered), list(evaluated)))

    def flush(self) -> None:
        """Wait until every queued step is written (before a checkpoint completes, and at the end)."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued and stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ writer thread

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as exc:  # records must never stop training; say so loudly instead
                self.errors += 1
                full = disk_full_error(exc)
                if full is not None:  # one line: which file, how much room; training goes on
                    where = full.filename or str(self.dir)
                    log.error("rollout records of step %s not written: cannot write '%s': %s (%s); training "
                              "goes on", item[0] if item else "?", where, (full.strerror or "").lower(),
                              free_space(where))
                else:
                    log.exception("writing the rollout records of step %s failed", item[0] if item else "?")
            finally:
                self._queue.task_done()

    def _write(self, step: int, groups: list[Any], batch: Any, policy_version: int, filtered: list[Any],
               evaluated: list[Any]) -> None:
        records = build_records(step, groups, batch, policy_version=policy_version, filtered=filtered,
                                evaluated=evaluated,
                                agents=self.agents,
                                token_text=self.text.pieces, decode=self.text.decode,
                                keep=self.keep if self.keep != 0 else 1, seed=self.seed)
        if self.keep != 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = records_path(self.dir.parent, step)
            tmp = path.with_name(path.name + ".tmp")
            try:
                with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1) as fh:
                    for record in records:
                        fh.write(dumps(record) + "\n")
            except OSError as exc:  # a full disk: no half-written file is left to take its room
                tmp.unlink(missing_ok=True)
                raise OSError(exc.errno, exc.strerror, str(path)) from None
            os.replace(tmp, path)
        for listener in self.listeners:
            try:
                listener(step, records)
            except Exception:
                log.exception("a rollout records listener failed at step %d", step)


def recorder_for_run(job: Any, output_dir: str | Path, tokenizer: Any, loggers: Sequence[Any],
                     first_step: int) -> RolloutRecorder:
    """The recorder of a run: ``run.rollout_records`` per step; as listeners, the loggers with the
    :class:`~loongsage_hookspecs.capabilities.TrajectoryLogger` capability whose
    ``wants_trajectories`` is true; the records of steps ``>= first_step`` (those the run is about
    to redo after a resume, or left by an earlier run) deleted."""
    listeners = [lg.log_trajectories for lg in loggers if isinstance(lg, TrajectoryLogger) and lg.wants_trajectories]
    recorder = RolloutRecorder(output_dir, tokenizer, keep=job.run.rollout_records,
                               agents={**{d.name: d.agent for d in job.data},
                                       **{f"eval:{d.name}": d.agent for d in job.eval.data}},
                               seed=job.run.seed, listeners=listeners)
    recorder.truncate_after(first_step)
    return recorder
