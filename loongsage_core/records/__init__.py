"""Rollout records: every step's trajectories on disk, token by token (format in docs/reference/records.md).

A run writes ``<run>/rollouts/step_NNNNNN.jsonl.gz``, one JSON object per trajectory, from a
writer thread (:class:`~.writer.RolloutRecorder`), so the training loop never waits on it.
:func:`read_rollouts` and :func:`rollout_steps` are the stable way to read them back; they import
nothing but the standard library, so ``import loongsage_core.records`` stays cheap.
"""

from .format import FORMAT_VERSION, ROLLOUTS_DIR, records_path
from .reader import RolloutRecordsError, read_rollouts, read_rollouts_partial, rollout_steps

__all__ = ["FORMAT_VERSION", "ROLLOUTS_DIR", "RolloutRecordsError", "read_rollouts", "read_rollouts_partial",
           "records_path", "rollout_steps"]
