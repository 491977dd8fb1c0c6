"""The job tables a backend reads, and the structuring of a component's ``*_args`` table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import AlgorithmConfig, JobConfig, LoraConfig, ModelConfig, RunConfig, TrainConfig, structure_args

if TYPE_CHECKING:  # pragma: no cover
    from loongsage_hookspecs import JobSettings

    def _the_job_is_what_backends_read(job: JobConfig) -> JobSettings:
        """Checked by the type checker (``tox -e type``): the host's schema keeps every field the
        contract promises backends (``loongsage_hookspecs.settings``)."""
        return job


__all__ = ["AlgorithmConfig", "JobConfig", "LoraConfig", "ModelConfig", "RunConfig", "TrainConfig", "structure_args"]
