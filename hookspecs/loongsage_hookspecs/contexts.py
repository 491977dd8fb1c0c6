"""What a component factory receives: one typed context per kind, always the first argument.

Every object-style spec's factory is called ``factory(ctx, **args)``: ``ctx`` is the context of
its kind (below) and ``args`` the job's ``*_args`` table for it. The context says what the host
knows about where the component runs; the arguments are the user's. :class:`BuildContext` is what
every context carries; a kind that receives more from the host has a subclass that adds it.

``where`` is the job-file key that named the component (``"job.toml: data[0].agent"``): a
factory that refuses something names it in its error, as the host does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import attrs

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .registry import ComponentRegistry
    from .settings import JobSettings


@attrs.define(frozen=True, kw_only=True)
class BuildContext:
    """What every factory receives: the job key that named the component, the job's settings a
    component may read (``None`` outside a run, e.g. a test building it by hand) and the plugin
    registry (``None`` likewise), through which a component may build the components it uses."""

    where: str = "<job>"
    job: "JobSettings | None" = None
    components: "ComponentRegistry | None" = None


@attrs.define(frozen=True, kw_only=True)
class TeacherContext(BuildContext):
    """A ``teacher`` factory's context: the ``[[teachers]]`` entry's ``name`` and its model
    directory ``path`` (resolved against the job file; ``None`` when the entry names none)."""

    name: str
    path: str | None = None


@attrs.define(frozen=True, kw_only=True)
class TeacherManagerContext(BuildContext):
    """A ``teacher_manager`` factory's context: the run's ``teachers`` by name (objects with
    ``forward``, and ``load`` / ``offload`` when they can leave the device), the ``routes`` from a
    data source's name to its teacher's (``None``: the source is not distilled), at most
    ``max_resident`` teachers loaded at once, and ``source_key``: the ``batch.meta`` key that
    holds each row's source."""

    teachers: Mapping[str, Any]
    routes: Mapping[str, str | None]
    max_resident: int = 1
    source_key: str = "source"
