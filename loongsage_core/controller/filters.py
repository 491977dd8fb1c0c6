"""The job's group filters, one pipeline for every loop: :class:`GroupFilters`.

``[algorithm] filters`` (dynamic sampling, length filters, ...) decide which finished groups are
trained on. The synchronous loop filters a step's groups together, the asynchronous one each
group as it finishes; both call :meth:`GroupFilters.accept`, which runs the filters in the job
file's order and counts what they dropped.
"""

from __future__ import annotations

from typing import Any, Sequence

from loongsage_hookspecs import ComponentRegistry, TrajectoryGroup

from ..config import JobConfig, refs_by_field


class GroupFilters:
    """The job's filters, bound, in job-file order; ``dropped`` counts the groups they removed."""

    def __init__(self, functions: Sequence[Any]) -> None:
        self.functions = list(functions)
        self.dropped = 0

    @classmethod
    def from_job(cls, job: JobConfig, components: ComponentRegistry) -> "GroupFilters":
        refs = refs_by_field(job.algorithm, "algorithm", job).get("filters", [])
        return cls([components.bind(ref) for ref in refs])

    def accept(self, groups: Sequence[TrajectoryGroup]) -> list[TrajectoryGroup]:
        """The groups every filter keeps (each filter sees what the ones before it kept)."""
        kept = list(groups)
        for fn in self.functions:
            before = len(kept)
            kept = list(fn(kept))
            self.dropped += before - len(kept)
        return kept
