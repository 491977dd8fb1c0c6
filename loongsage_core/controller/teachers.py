"""Distillation teachers of a run: building them, routing rows to them, and their batch tensors.

A job lists teachers in ``[[teachers]]`` and points data sources at them (``[[data]] teacher =
"big"``). :class:`TeacherGroup` builds each teacher through its backend's factory the first time
one of its rows needs scoring, and hands the rows of a step to the teacher manager that
``[placement] teacher_manager`` names (a ``teacher_manager`` component, e.g. the distill plugin's
``per_source``: rows by ``batch.meta["source"]``, at most ``[placement] max_resident_teachers``
loaded, the least recently used offloaded first). ``[placement] teacher_offload`` says what
offloading does: ``"cpu"`` calls the teacher's own ``offload()`` (weights leave the accelerator,
host memory keeps them); ``"release"`` also drops the teacher, so a later use rebuilds it from
its ``path``.

Which tensors the teachers fill, and under which names, follows from :class:`DistillSetup`:

* ``[algorithm] distill_kl`` unset: the teachers stand in for the reference model and the
  ``[algorithm] kl`` term reads them: ``ref_logprobs`` ``[B, T]``, plus ``ref_topk_ids`` /
  ``ref_topk_logprobs`` ``[B, T, distill_topk]`` when that term ``requires = "topk"``, or
  ``ref_logits`` ``[B, T, V]`` when it ``requires = "logits"``;
* ``distill_kl`` set: the same tensors named ``teacher_logprobs``, ``teacher_topk_ids``,
  ``teacher_topk_logprobs``, ``teacher_logits`` (so an ordinary reference KL can run beside it).

Both add ``teacher_mask`` ``[B, T]`` (float): 1 on every position of a row whose source has a
teacher, 0 on rows without one (their teacher tensors are zeros), to be multiplied into the mask
of the distillation term. All tensors follow the layout of ``loongsage_hookspecs.records``.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any, Callable

import attrs

from loongsage_hookspecs import (
    Batch,
    KLInputs,
    ResidentTeacher,
    TeacherContext,
    TeacherManagerContext,
    TeacherManagerSpec,
    TeacherRouter,
)

from ..algorithms.distill import REQUIRES_LEVELS, DistillSetup, distill_setup
from ..algorithms.pipeline import TEACHER_MASK_KEY
from ..config import JobConfig, component_ref

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

class LazyTeacher:
    """One ``[[teachers]]`` entry, built on first load through its backend's factory.

    ``load()`` builds the teacher if needed and calls its ``load()`` (when it has one);
    ``offload()`` calls its ``offload()`` and, with ``release = True``, drops it so its memory
    can be freed (the next ``load()`` builds it again). ``builds`` counts the builds.
    """

    def __init__(self, name: str, build: Callable[[], Any], *, release: bool = False) -> None:
        self.name = name
        self._build = build
        self.release = release
        self.teacher: Any = None
        self.builds = 0

    def load(self) -> None:
        if self.teacher is None:
            self.teacher = self._build()
            self.builds += 1
        if isinstance(self.teacher, ResidentTeacher):
            self.teacher.load()

    def offload(self) -> None:
        if self.teacher is None:
            return
        if isinstance(self.teacher, ResidentTeacher):
            self.teacher.offload()
        if self.release:
            self.teacher = None
            gc.collect()

    def forward(self, batch: Batch, **kwargs: Any) -> Any:
        if self.teacher is None:
            raise RuntimeError(f"teacher '{self.name}': forward before load()")
        return self.teacher.forward(batch, **kwargs)  # the build checked the Teacher protocol


def _teacher_builder(job: JobConfig, host: Any, index: int) -> Callable[[], Any]:
    t = job.teachers[index]
    ref = component_ref(job, f"teachers[{index}].backend")
    host.get("teacher", t.backend, where=ref.where)  # an unknown backend fails now, not on first use
    ctx = TeacherContext(where=ref.where, job=job, components=host, name=t.name,
                         path=job.resolve_path(t.path) if t.path else None)

    def build() -> Any:
        return host.bind(ref, ctx)

    return build


class TeacherGroup:
    """The run's teachers behind one ``forward``: per-source routing and bounded residency.

    Build with :meth:`from_job` (``None`` when the job distils nothing). Teachers are built on
    first use, so a teacher no source routes to is never built.
    """

    def __init__(self, teachers: dict[str, "LazyTeacher"], setup: DistillSetup, manager: TeacherRouter,
                 metrics_fn: Callable[..., dict[str, float]] | None) -> None:
        self.setup = setup
        self.teachers = teachers
        self.manager = manager
        self.metrics_fn = metrics_fn

    @classmethod
    def from_job(cls, job: JobConfig, host: Any) -> "TeacherGroup | None":
        """The job's teachers, routes from ``[[data]] teacher`` and the ``[placement]`` residency."""
        setup = distill_setup(job, host)
        if setup is None:
            return None
        ref = component_ref(job, "placement.teacher_manager")
        where = ref.where
        spec: TeacherManagerSpec = host.get("teacher_manager", job.placement.teacher_manager, where=where)
        release = job.placement.teacher_offload == "release"
        teachers = {t.name: LazyTeacher(t.name, _teacher_builder(job, host, i), release=release)
                    for i, t in enumerate(job.teachers)}
        routes = {src.name: src.teacher for src in job.data}
        ctx = TeacherManagerContext(where=where, job=job, components=host, teachers=teachers, routes=routes,
                                    max_resident=job.placement.max_resident_teachers, source_key="source")
        manager = host.bind(ref, ctx)
        return cls(teachers, setup, manager, spec.metrics)

    # -- routing -----------------------------------------------------------------------------

    def plan(self, batch: Batch) -> dict[str, list[int]]:
        """Teacher name -> its rows of ``batch``, in the order they will run."""
        return self.manager.plan(batch)

    def row_mask(self, batch: Batch) -> "torch.Tensor":
        """``[B]`` bool: rows whose source has a teacher."""
        return self.manager.row_mask(batch)

    @property
    def resident(self) -> tuple[str, ...]:
        """Teachers loaded now, least recently used first."""
        return self.manager.resident

    @property
    def loads(self) -> int:
        return self.manager.loads

    # -- scoring -----------------------------------------------------------------------------

    def forward(self, batch: Batch, requires: str | None = None) -> dict[str, "torch.Tensor"]:
        """Teacher tensors for every row of ``batch``, named for the batch (see the module doc).

        ``requires`` (default: the setup's) is the level the distillation term needs:
        ``"logprobs"`` gives ``<prefix>logprobs``; ``"topk"`` adds ``<prefix>topk_ids`` /
        ``<prefix>topk_logprobs``; ``"logits"`` adds ``<prefix>logits``. ``teacher_mask`` is
        always included. A batch none of whose rows has a teacher gets zeros and a zero mask
        without running any teacher (``<prefix>logits`` then has an empty last axis ``[B, T, 0]``;
        the loss pipeline skips a teacher-fed term on micro-batches whose mask is all 0).
        """
        import torch

        level = requires or self.setup.requires
        if level not in REQUIRES_LEVELS:
            raise ValueError(f"TeacherGroup.forward: requires must be one of {list(REQUIRES_LEVELS)}, "
                             f"got {level!r}")
        ids = batch["input_ids"]
        rows, width = ids.shape
        topk = (self.setup.topk or 0) if level == "topk" else 0
        if level == "topk" and topk == 0:
            raise ValueError("TeacherGroup.forward: requires='topk' but the setup computes no top-k "
                             "(the distillation term does not require 'topk')")
        covered = self.row_mask(batch)
        mask = covered.to(torch.float32)[:, None].expand(rows, width).contiguous()
        p = self.setup.prefix
        if not bool(covered.any()):
            out: dict[str, torch.Tensor] = {p + "logprobs": torch.zeros(rows, width)}
            if topk:
                out[p + "topk_ids"] = torch.zeros(rows, width, topk, dtype=torch.long)
                out[p + "topk_logprobs"] = torch.zeros(rows, width, topk)
            if level == "logits":  # no teacher ran, so the vocabulary size is unknown: an empty last axis
                out[p + "logits"] = torch.zeros(rows, width, 0)
            out[TEACHER_MASK_KEY] = mask
            return out
        res = self.manager.forward(batch, topk=topk, return_logits=level == "logits")
        out = {p + "logprobs": res.logprobs.float()}
        if topk:
            out[p + "topk_ids"] = _returned(res.topk_ids, "topk_ids")
            out[p + "topk_logprobs"] = _returned(res.topk_logprobs, "topk_logprobs")
        if level == "logits":
            out[p + "logits"] = _returned(res.logits, "logits")
        out[TEACHER_MASK_KEY] = mask
        return out

    def offload_all(self) -> None:
        """Offload every loaded teacher (e.g. before the trainer needs the accelerator)."""
        self.manager.offload_all()

    def close(self) -> None:
        """Offload everything and drop every built teacher."""
        self.offload_all()
        for t in self.teachers.values():
            if isinstance(t, LazyTeacher):
                t.teacher = None
        gc.collect()


def _returned(value: "torch.Tensor | None", field: str) -> "torch.Tensor":
    """A field the teacher manager was asked for; its absence is the manager's bug, said as such."""
    if value is None:
        raise RuntimeError(f"teacher manager: asked for '{field}', its forward returned TeacherOutputs "
                           f"without it")
    return value


@attrs.define
class TeacherScores:
    """One scoring of a step's rows (:meth:`TeacherGroup.score`), as the teacher actor returns it
    to the controller: the batch ``tensors`` (see the module doc), the ``plan`` (teacher name ->
    its rows), the teacher ``loads`` and ``builds`` this scoring took, the number of teachers
    ``resident`` after it and the ``seconds`` it took where the teachers run."""

    tensors: dict[str, "torch.Tensor"]
    plan: dict[str, list[int]]
    loads: int
    builds: int
    resident: int
    seconds: float


def score_rows(group: TeacherGroup, batch: Batch) -> TeacherScores:
    """Score ``batch`` with ``group`` (:meth:`TeacherGroup.forward`) and count what it took."""
    start = time.perf_counter()
    loads_before = group.loads
    builds_before = sum(t.builds for t in group.teachers.values())
    plan = group.plan(batch)
    tensors = group.forward(batch)
    return TeacherScores(tensors=tensors, plan=plan, loads=group.loads - loads_before,
                         builds=sum(t.builds for t in group.teachers.values()) - builds_before,
                         resident=len(group.resident), seconds=time.perf_counter() - start)


# --------------------------------------------------------------------------------------------
# What the controller computes from a scoring
# --------------------------------------------------------------------------------------------


def teacher_metrics(batch: Batch, setup: DistillSetup, scores: TeacherScores,
                    manager_metrics: Callable[..., dict[str, float]] | None) -> dict[str, float]:
    """The step metrics of a scoring whose tensors are in ``batch`` (after ``old_logprobs``).

    ``perf/teacher_*`` (builds and loads this step, resident count, ``perf/teacher_seconds``
    where the teachers ran), ``train/teacher_row_ratio``, the teacher manager's
    ``manager_metrics`` (the distill plugin's ``train/opd_*``) over the distilled tokens (those
    its inputs allow: the controller has the student's sampled log-probs, not its logits), plus
    ``train_per_teacher/<name>/opd_kl`` and ``.../rows``.
    """
    mask = batch[TEACHER_MASK_KEY]
    metrics: dict[str, float] = {
        "perf/teacher_loads": float(scores.loads),
        "perf/teacher_builds": float(scores.builds),
        "perf/teachers_resident": float(scores.resident),
        "perf/teacher_seconds": scores.seconds,
        "train/teacher_row_ratio": float(mask[:, 0].mean()) if len(batch) else 0.0,
    }
    metrics.update(_distill_metrics(batch, setup, scores.plan, manager_metrics))
    return metrics


def _distill_metrics(batch: Batch, setup: DistillSetup, plan: dict[str, list[int]],
                     manager_metrics: Callable[..., dict[str, float]] | None) -> dict[str, float]:
    """The teacher manager's own metrics (when it has any) and the per-teacher gap."""
    student = batch.get("old_logprobs")
    if student is None:
        return {}
    out: dict[str, float] = {}
    if manager_metrics is not None:
        mask = batch["loss_mask"] * batch[TEACHER_MASK_KEY]
        inputs = KLInputs(logprobs=student, ref_logprobs=batch[setup.key("logprobs")], response_mask=mask,
                          ref_topk_ids=batch.get(setup.key("topk_ids")),
                          ref_topk_logprobs=batch.get(setup.key("topk_logprobs")),
                          ref_logits=batch.get(setup.key("logits")))
        out.update({k: float(v) for k, v in manager_metrics(inputs, input_ids=batch["input_ids"]).items()})
    for name, rows in plan.items():
        sub = batch.select(rows)
        sub_mask = sub["loss_mask"] > 0
        if bool(sub_mask.any()):
            diff = (sub["old_logprobs"] - sub[setup.key("logprobs")])[sub_mask]
            out[f"train_per_teacher/{name}/opd_kl"] = float(diff.mean())
            out[f"train_per_teacher/{name}/rows"] = float(len(rows))
    return out
