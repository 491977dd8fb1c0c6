"""Routing a batch to several teachers, with a bound on how many sit on the device at once.

A job may distil different data sources from different teachers (``[[data]] teacher = "big"``).
:class:`TeacherManager` splits a :class:`~loongsage_hookspecs.Batch` by the teacher of each row's
source, runs each teacher's forward once on its rows and scatters the
:class:`~loongsage_hookspecs.TeacherOutputs` back into row order.

Residency: a teacher object that has both ``load()`` (move onto the device) and ``offload()``
(move off it) methods is *managed*: the manager assumes it starts offloaded, loads it before its
forward and keeps at most ``max_resident`` managed teachers loaded, offloading the least recently
used one first. ``max_resident = 0`` offloads each teacher right after its forward (a colocated
setup that gives the device back to the trainer). Teachers without those methods are always
considered resident and do not count. Teachers already loaded run first in a step, so a step
that needs the teacher left loaded by the previous step does not swap it out and back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from loongsage_hookspecs import Batch, TeacherManagerContext, TeacherOutputs

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


class TeacherRoutingError(ValueError):
    """A row's source has no teacher route, or the routes name a teacher that does not exist."""


def _managed(teacher: Any) -> bool:
    return callable(getattr(teacher, "load", None)) and callable(getattr(teacher, "offload", None))


class TeacherManager:
    """Runs named teachers over the rows routed to them and reassembles the outputs.

    ``teachers`` maps a teacher name to an object with ``forward(batch, *, topk=0, ...)`` (the
    ``Teacher`` protocol) or to a callable with that signature; each returns ``TeacherOutputs``
    for the rows it was given, ``[b, T]`` aligned with the tokens. ``routes`` maps a data source
    to a teacher name, or to ``None`` for a source that is not distilled; sources not in
    ``routes`` go to ``default`` (an error when it is unset). ``source_key`` names the per-row
    ``batch.meta`` list holding each row's source.
    """

    def __init__(self, teachers: Mapping[str, Any], routes: Mapping[str, str | None], *,
                 max_resident: int = 1, default: str | None = None, source_key: str = "source") -> None:
        if not teachers:
            raise TeacherRoutingError("TeacherManager: no teachers given")
        for name, teacher in teachers.items():
            if not callable(getattr(teacher, "forward", None)) and not callable(teacher):
                raise TypeError(f"TeacherManager: teacher {name!r} has no forward(batch, topk=...) method and is "
                                f"not callable ({type(teacher).__name__})")
        known = ", ".join(sorted(teachers))
        for source, target in routes.items():
            if target is not None and target not in teachers:
                raise TeacherRoutingError(f"TeacherManager: source {source!r} routes to unknown teacher {target!r}; "
                                          f"teachers: {known}")
        if default is not None and default not in teachers:
            raise TeacherRoutingError(f"TeacherManager: default teacher {default!r} is unknown; teachers: {known}")
        if isinstance(max_resident, bool) or not isinstance(max_resident, int) or max_resident < 0:
            raise ValueError(f"TeacherManager: max_resident must be an integer >= 0, got {max_resident!r}")
        self.teachers = dict(teachers)
        self.routes = dict(routes)
        self.default = default
        self.max_resident = max_resident
        self.source_key = source_key
        self._resident: list[str] = []  # managed teachers on the device, least recently used first
        self.loads = 0
        self.offloads = 0

    # -- routing ---------------------------------------------------------------------------------

    @property
    def resident(self) -> tuple[str, ...]:
        """Managed teachers currently loaded, least recently used first."""
        return tuple(self._resident)

    def teacher_for(self, source: Any) -> str | None:
        """The teacher name of ``source`` (``None``: rows of this source are not distilled)."""
        if source in self.routes:
            return self.routes[source]
        if self.default is not None:
            return self.default
        listing = ", ".join(repr(s) for s in sorted(self.routes, key=str)) or "none"
        raise TeacherRoutingError(f"TeacherManager: data source {source!r} has no teacher route and no default "
                                  f"teacher is set; routed sources: {listing}")

    def _sources(self, batch: Batch) -> list[Any]:
        n = len(batch)
        sources = batch.meta.get(self.source_key)
        if sources is None:
            if self.default is None:
                raise TeacherRoutingError(f"TeacherManager: the batch has no meta[{self.source_key!r}] list and no "
                                          "default teacher is set")
            return [None] * n
        if len(sources) != n:
            raise TeacherRoutingError(f"TeacherManager: meta[{self.source_key!r}] has {len(sources)} entries for "
                                      f"{n} rows")
        return list(sources)

    def plan(self, batch: Batch) -> dict[str, list[int]]:
        """Teacher name -> its row indices (ascending), in the order the teachers will run.

        Teachers already loaded come first (most recently used first), the others in the order
        their first row appears in the batch.
        """
        groups: dict[str, list[int]] = {}
        for row, source in enumerate(self._sources(batch)):
            name = self.teacher_for(source)
            if name is not None:
                groups.setdefault(name, []).append(row)
        loaded = [n for n in reversed(self._resident) if n in groups]
        order = loaded + [n for n in groups if n not in loaded]
        return {n: groups[n] for n in order}

    def row_mask(self, batch: Batch) -> "torch.Tensor":
        """``[B]`` bool: rows that have a teacher (multiply into the loss mask of the distill term)."""
        import torch

        covered = {row for rows in self.plan(batch).values() for row in rows}
        return torch.tensor([i in covered for i in range(len(batch))], dtype=torch.bool)

    # -- residency -------------------------------------------------------------------------------

    def _ensure_loaded(self, name: str) -> None:
        teacher = self.teachers[name]
        if not _managed(teacher):
            return
        if name in self._resident:
            self._resident.remove(name)
            self._resident.append(name)
            return
        while self._resident and len(self._resident) >= max(self.max_resident, 1):
            self._offload(self._resident[0])
        teacher.load()
        self.loads += 1
        self._resident.append(name)

    def _offload(self, name: str) -> None:
        self.teachers[name].offload()
        self.offloads += 1
        self._resident.remove(name)

    def offload_all(self) -> None:
        """Offload every loaded managed teacher (e.g. before the trainer needs the device)."""
        for name in list(self._resident):
            self._offload(name)

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, batch: Batch, *, topk: int = 0, return_logits: bool = False) -> TeacherOutputs:
        """Teacher outputs for every row of ``batch``, in row order.

        Each teacher runs once, on ``batch.select(its rows)``, with ``topk`` (and
        ``return_logits=True`` only when asked, so teachers without that option still work).
        Rows without a teacher get zeros everywhere (see :meth:`row_mask`). Outputs are placed on
        the device of ``batch["input_ids"]`` (the CPU when absent).
        """
        import torch

        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
            raise ValueError(f"TeacherManager.forward: topk must be an integer >= 0, got {topk!r}")
        plan = self.plan(batch)
        rows_total = len(batch)
        ids = batch.get("input_ids")
        device = ids.device if ids is not None else torch.device("cpu")
        width = int(ids.shape[1]) if ids is not None else None
        kwargs: dict[str, Any] = {"topk": topk}
        if return_logits:
            kwargs["return_logits"] = True

        results: list[tuple[str, list[int], TeacherOutputs]] = []
        for name, rows in plan.items():
            self._ensure_loaded(name)
            try:
                teacher = self.teachers[name]
                fn = teacher.forward if callable(getattr(teacher, "forward", None)) else teacher
                out = fn(batch.select(rows), **kwargs)
            finally:
                if self.max_resident == 0 and name in self._resident:
                    self._offload(name)
            width = self._check(name, out, len(rows), width, topk, return_logits)
            results.append((name, rows, out))
        if width is None:
            raise TeacherRoutingError("TeacherManager.forward: no row of the batch has a teacher and the batch has "
                                      "no input_ids to size the outputs")
        return _scatter_outputs(results, rows_total, width, device, topk, return_logits)

    __call__ = forward

    @staticmethod
    def _check(name: str, out: Any, rows: int, width: int | None, topk: int, return_logits: bool) -> int:
        import torch

        where = f"TeacherManager: teacher {name!r}"
        if not isinstance(out, TeacherOutputs):
            raise TypeError(f"{where} returned {type(out).__name__}, expected TeacherOutputs")
        lp = out.logprobs
        if not isinstance(lp, torch.Tensor) or lp.dim() != 2 or lp.shape[0] != rows:
            raise ValueError(f"{where} returned logprobs of shape {tuple(getattr(lp, 'shape', ()))}, expected "
                             f"[{rows}, T]")
        if width is not None and lp.shape[1] != width:
            raise ValueError(f"{where} returned {lp.shape[1]} token positions, expected {width} (the batch width)")
        if topk:
            for field in ("topk_ids", "topk_logprobs"):
                t = getattr(out, field)
                if t is None or tuple(t.shape) != (rows, lp.shape[1], topk):
                    raise ValueError(f"{where} returned {field} of shape {tuple(getattr(t, 'shape', ()))}, expected "
                                     f"({rows}, {lp.shape[1]}, {topk})")
        if return_logits and (out.logits is None or out.logits.dim() != 3
                              or tuple(out.logits.shape[:2]) != tuple(lp.shape)):
            raise ValueError(f"{where} returned logits of shape {tuple(getattr(out.logits, 'shape', ()))}, expected "
                             f"[{rows}, {lp.shape[1]}, V]")
        return int(lp.shape[1])


def _scatter_outputs(results: list[tuple[str, list[int], TeacherOutputs]], rows_total: int, width: int,
                     device: "torch.device", topk: int, return_logits: bool) -> TeacherOutputs:
    """One ``TeacherOutputs`` of ``rows_total`` rows with each teacher's rows copied into place."""
    import torch

    def place(field: str, trailing: tuple[int, ...], dtype: "torch.dtype") -> "torch.Tensor":
        full = torch.zeros((rows_total, width, *trailing), dtype=dtype, device=device)
        for _, rows, out in results:
            part = getattr(out, field)
            index = torch.as_tensor(rows, dtype=torch.long, device=device)
            full.index_copy_(0, index, part.detach().to(device=device, dtype=dtype))
        return full

    lp_dtype = results[0][2].logprobs.dtype if results else torch.float32
    logprobs = place("logprobs", (), lp_dtype)
    topk_ids = topk_logprobs = logits = None
    if topk:
        topk_ids = place("topk_ids", (topk,), torch.long)
        topk_logprobs = place("topk_logprobs", (topk,), lp_dtype)
    if return_logits:
        vocab = {out.logits.shape[-1] for _, _, out in results}
        if len(vocab) > 1:
            sizes = {name: out.logits.shape[-1] for name, _, out in results}
            raise ValueError(f"TeacherManager: teachers in one batch return different vocabulary sizes {sizes}; "
                             "full logits cannot share one tensor (route such sources to separate batches)")
        logits = place("logits", (vocab.pop() if vocab else 0,),
                       results[0][2].logits.dtype if results else torch.float32)
    return TeacherOutputs(logprobs=logprobs, topk_ids=topk_ids, topk_logprobs=topk_logprobs, logits=logits)


def make_teacher_manager(ctx: TeacherManagerContext, **args: Any) -> TeacherManager:
    """Factory of the ``per_source`` teacher manager spec: the run's teachers, routes and
    residency bound come from the context; ``args`` are :class:`TeacherManager`'s other keyword
    arguments (``default``)."""
    return TeacherManager(ctx.teachers, ctx.routes, max_resident=ctx.max_resident, source_key=ctx.source_key,
                          **args)
