"""``loongsage run``'s entry point: picks the synchronous or asynchronous controller for a job.

It sits above both controllers (:mod:`.run` and :mod:`.async_run`, which builds on the first),
so neither needs to know of the other.
"""

from __future__ import annotations

from pathlib import Path

from ..resolve import ResolvedJob
from ..validation import check_output_dir
from .async_run import AsyncRLController
from .run import RLController
from .run_dir import prepare_run_dir


def run_job(resolved: ResolvedJob, output_dir: str | None = None, *, overwrite: bool = False,
            ) -> list[dict[str, float]]:
    """Train the resolved job; returns the metrics of every step run.

    A directory that already holds a run is continued (``run.resume = true``), moved aside
    (``overwrite``) or refused: see :mod:`loongsage_core.controller.run_dir`.
    """
    job = resolved.job
    out = Path(output_dir or job.resolve_path(job.run.output_dir))
    check_output_dir(out, "--output-dir" if output_dir else f"{job.source_path or '<job>'}: run.output_dir")
    prepare_run_dir(out, resume=job.run.resume, overwrite=overwrite, where=job.source_path or "<job>")
    if job.async_.enable:
        controller: RLController = AsyncRLController(resolved, out)
    else:
        controller = RLController(resolved, out)
    try:
        controller.start()
        return controller.fit()
    except Exception as exc:
        explained = controller.faults.explain(exc)  # a dead actor: say which, where and why
        if explained is exc:
            raise
        raise explained from None
    finally:
        controller.close()
