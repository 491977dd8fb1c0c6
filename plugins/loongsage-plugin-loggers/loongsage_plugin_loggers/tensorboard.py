"""The ``tensorboard`` logger: every numeric metric as a TensorBoard scalar.

Writes event files under ``<output_dir>/<log_dir>`` with tensorboardX (a dependency of this
plugin) or, when that is missing, ``torch.utils.tensorboard``. Both are imported when the
first step is logged. On resume, :meth:`TensorBoardLogger.truncate_after` makes the writer purge
the events of the steps the resumed run will redo.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # pragma: no cover - typing only
    from loongsage_hookspecs import LoggerContext


def _summary_writer_class() -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError("tensorboard logger needs tensorboardX (pip install tensorboardX) or torch with "
                              "the tensorboard package") from None
    return SummaryWriter


class TensorBoardLogger:
    """Writes each step's numeric metrics with ``add_scalar(name, value, step)``.

    Args:
        ctx: the logger's context (``ctx.output_dir``: the run's output directory).
        log_dir: sub-directory of ``output_dir`` for the event files.
        flush_secs: how often the writer flushes to disk, in seconds (also flushed on close).

    Non-numeric values (strings) and non-finite numbers are skipped.
    """

    def __init__(self, ctx: "LoggerContext", *, log_dir: str = "tensorboard", flush_secs: int = 10) -> None:
        self.log_dir = Path(ctx.output_dir) / log_dir
        self.flush_secs = int(flush_secs)
        self._writer: Any = None
        self._purge_step: int | None = None
        self._closed = False

    def _get_writer(self) -> Any:
        if self._writer is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            # a unique suffix: event file names otherwise only carry the second and the host, so a
            # writer reopened within the same second (a quick resume) would overwrite the old file
            suffix = f".{os.getpid()}.{time.time_ns()}"
            kwargs: dict[str, Any] = {"flush_secs": self.flush_secs, "filename_suffix": suffix}
            if self._purge_step is not None:
                kwargs["purge_step"] = self._purge_step
            self._writer = _summary_writer_class()(str(self.log_dir), **kwargs)
        return self._writer

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._closed:
            raise RuntimeError(f"tensorboard logger: log() after close() ({self.log_dir})")
        writer = self._get_writer()
        for key, value in metrics.items():
            if key == "step" or isinstance(value, bool):
                continue
            if hasattr(value, "item"):
                value = value.item()
            if isinstance(value, numbers.Real) and math.isfinite(float(value)):
                writer.add_scalar(str(key), float(value), int(step))

    def truncate_after(self, step: int) -> None:
        """Have the writer purge earlier events at steps ``>= step`` (reopening it if open)."""
        self._purge_step = int(step)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        self._closed = True
