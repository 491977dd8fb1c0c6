"""What a component factory receives: one typed context per kind, always the first argument.

Every object-style spec's factory is called ``factory(ctx, **args)``: ``ctx`` is the context of
its kind (below) and ``args`` the job's ``*_args`` table for it. The context says what the host
knows about where the component runs; the arguments are the user's. :class:`BuildContext` is what
every context carries; a kind that receives more from the host has a subclass that adds it.
One way to build every kind: what the host supplies never travels as a keyword a job file could
also set, so a user's ``*_args`` and the host's inputs cannot collide, and a factory's signature
(after ``ctx``) is exactly the arguments a job may give it.

Which kind gets which context: each kind's :class:`~loongsage_hookspecs.kinds.Call` in
:data:`~loongsage_hookspecs.KINDS`. Agents, data sources, sandboxes and router middleware get
:class:`BuildContext` itself; the train backend and rollout engine contexts
(:class:`~loongsage_hookspecs.protocols.TrainWorkerContext`,
:class:`~loongsage_hookspecs.protocols.EngineContext`) subclass it too.

``where`` is the job-file key that named the component (``"job.toml: data[0].agent"``): a
factory that refuses something names it in its error, as the host does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

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


@attrs.define(frozen=True, kw_only=True)
class LoggerContext(BuildContext):
    """A ``logger`` factory's context: the run directory ``output_dir`` it may write into, the
    run's planned ``total_steps`` (a progress display's denominator) and ``start_step``, the step
    the run (re)starts from (0 for a fresh run; a resumed run's checkpoint step). A logger that
    declares :class:`~loongsage_hookspecs.capabilities.StepTruncation` is still told, with
    ``truncate_after``, to forget the steps after ``start_step``."""

    output_dir: str
    total_steps: int
    start_step: int = 0


@attrs.define(frozen=True, kw_only=True)
class EngineRouterContext(BuildContext):
    """An ``engine_router`` factory's context: the base URLs of the rollout engines it balances
    over (``http://HOST:PORT``, one per engine, in engine order) and the run secret ``api_key``
    the engines require as ``Authorization: Bearer`` (``None``: the engines are open)."""

    engine_urls: tuple[str, ...]
    api_key: str | None = attrs.field(default=None, repr=False)


@attrs.define(frozen=True, kw_only=True)
class SchedulerContext(BuildContext):
    """An asynchronous ``scheduler`` factory's context: ``batch_size``, the prompt groups one train
    step consumes (``rollout.prompts_per_step``), the staleness bound ``stale_steps``
    (``async.stale_steps``) and ``quota``: ``quota(version) -> {source: groups}``, the ``[[data]]``
    weights apportioned over ``batch_size`` for the step at that trainer version. ``quota`` is set
    only for a scheduler whose spec declares
    :class:`~loongsage_hookspecs.capabilities.SourcePicker` (``None`` otherwise)."""

    batch_size: int
    stale_steps: int = 1
    quota: Callable[[int], Mapping[str, int]] | None = None


@attrs.define(frozen=True, kw_only=True)
class WeightTransportContext(BuildContext):
    """A weight transport's context, for its ``sender`` (built in a trainer rank, ``role =
    "sender"``) and its ``receiver`` (built in an engine on the first update request in its format,
    ``role = "receiver"``): one transport's two halves read the same ``*_args`` and tell apart which
    side they build from ``role``."""

    role: Literal["sender", "receiver"]
