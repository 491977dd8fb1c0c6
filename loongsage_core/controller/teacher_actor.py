"""The run's distillation teachers in a Ray actor of their own, in the run's placement group.

Teachers are models: like the trainer ranks, the engines and the critic they live in an actor,
never in the driver process (whose memory and CPU belong to the loop, the router and the agents).
:class:`TeacherActor` holds the job's :class:`.teachers.TeacherGroup` (teachers built on first
use, routed per source, at most ``[placement] max_resident_teachers`` loaded) in the bundle the
run's placement group reserves for it (``[placement] teacher_cpus`` / ``teacher_gpus`` /
``teacher_resources``; :func:`.placement.create_placement_group`).

Per step the controller calls :meth:`Teachers.apply`: the step's rows go to the actor once (the
object the policy's worker group already shipped, when there is one: no second pickling), the
actor returns the teacher tensors and what the scoring took (:class:`.teachers.TeacherScores`),
and the controller puts the tensors into the batch and computes the step's distillation metrics
(:func:`.teachers.teacher_metrics`) next to the student's old log-probs.

:meth:`Teachers.local` gives the same handle over an in-process actor
(:class:`.remote.LocalActor`), for the controller tests that run a step without a Ray cluster.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from loongsage_hookspecs import Batch

from ..algorithms.distill import DistillSetup, distill_setup
from ..config import JobConfig
from ..plugins import PluginHost
from .remote import LocalActor, gather
from .teachers import TeacherGroup, TeacherScores, score_rows, teacher_metrics


class TeacherActor:
    """The teachers of one run, in one process (wrapped with ``ray.remote`` by :meth:`Teachers.create`).

    Rebuilds the plugin host from the job (user hookimpl modules load here too) and the job's
    :class:`.teachers.TeacherGroup`; no teacher model is built until a step's rows need it.
    """

    def __init__(self, job: JobConfig) -> None:
        self.job = job
        self.host = PluginHost.from_job(job)
        group = TeacherGroup.from_job(job, self.host)
        if group is None:
            raise ValueError(f"{job.source_path or '<job>'}: a teacher actor was started for a job that "
                             "distils nothing (no [[data]] source names a teacher)")
        self.group = group

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid()}

    def score(self, batch: Batch) -> TeacherScores:
        """The teacher tensors of every row of ``batch`` and what scoring them took."""
        return score_rows(self.group, batch)

    def shutdown(self) -> None:
        """Offload and drop every teacher built."""
        self.group.close()


class Teachers:
    """The controller's handle on the teacher actor: scoring a step's rows, and closing.

    ``setup`` is the run's :class:`~loongsage_core.algorithms.distill.DistillSetup` and
    ``manager_metrics`` the teacher manager spec's metrics function; both are read in the driver,
    where the step's metrics are computed.
    """

    def __init__(self, actor: Any, setup: DistillSetup,
                 manager_metrics: Callable[..., dict[str, float]] | None) -> None:
        self.actor = actor
        self.setup = setup
        self.manager_metrics = manager_metrics

    @staticmethod
    def _driver_side(job: JobConfig, host: PluginHost) -> tuple[DistillSetup, Any] | None:
        setup = distill_setup(job, host)
        if setup is None:
            return None
        spec = host.get("teacher_manager", job.placement.teacher_manager,
                        where=f"{job.source_path or '<job>'}: placement.teacher_manager")
        return setup, spec.metrics

    @classmethod
    def create(cls, job: JobConfig, host: PluginHost, placement_group: Any = None,
               bundle: int | None = None) -> "Teachers | None":
        """Start the teacher actor on the (initialised) Ray cluster, in bundle ``bundle`` of the
        run's ``placement_group`` (``None``: anywhere, with the ``[placement] teacher_*``
        reservation); ``None`` when the job distils nothing."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        driver = cls._driver_side(job, host)
        if driver is None:
            return None
        pl = job.placement
        resources = {k: float(v) for k, v in pl.teacher_resources.items() if v > 0} or None
        options: dict[str, Any] = {"num_cpus": pl.teacher_cpus, "num_gpus": pl.teacher_gpus, "resources": resources}
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=bundle or 0)
        remote: Any = ray.remote(TeacherActor)  # Ray's stubs do not type actor handles' method calls
        actor = remote.options(**options).remote(job)
        try:
            ray.get(actor.ready.remote())
        except BaseException:
            ray.kill(actor)
            raise
        return cls(actor, *driver)

    @classmethod
    def local(cls, job: JobConfig, host: PluginHost) -> "Teachers | None":
        """The same handle over an in-process :class:`TeacherActor` (no Ray cluster)."""
        driver = cls._driver_side(job, host)
        if driver is None:
            return None
        return cls(LocalActor(TeacherActor(job)), *driver)

    def apply(self, batch: Batch, shared: Any = None) -> dict[str, float]:
        """Score ``batch`` with the teachers, store their tensors in it, return the step's metrics
        (``timing/teacher`` and those of :func:`.teachers.teacher_metrics`).

        ``shared`` is ``batch`` as the policy's worker group shipped it (its rows, without the
        tensors added since; the teachers read only the tokens and each row's source); without
        it the batch is shipped here. Call after ``old_logprobs`` are in the batch.
        """
        if len(batch) == 0:
            return {}
        start = time.perf_counter()
        (scores,) = gather([self.actor.score.remote(batch if shared is None else shared)])
        batch.tensors.update(scores.tensors)
        metrics = {"timing/teacher": time.perf_counter() - start}
        metrics.update(teacher_metrics(batch, self.setup, scores, self.manager_metrics))
        return metrics

    def close(self) -> None:
        """Drop every teacher and stop the actor."""
        if isinstance(self.actor, LocalActor):
            self.actor.obj.shutdown()
            return
        import ray

        try:
            ray.get(self.actor.shutdown.remote())
        except Exception:  # an actor that already died has nothing left to close
            pass
        ray.kill(self.actor)
