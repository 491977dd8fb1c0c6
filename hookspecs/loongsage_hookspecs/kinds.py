"""The component kinds of the LoongSage contract: the :data:`KINDS` table, one :class:`Kind` each.

A kind is everything the host needs to know to turn a job file's name into a working component,
in one record:

* ``name``: the word a job file and ``loongsage plugins`` use (``reward``, ``train_backend``, ...);
* ``hook``: the provider hook of :mod:`.hookspecs` that yields its specs, and ``spec``: their class;
* ``calls``: how the host calls the spec's callables, one :class:`Call` per callable field. A
  *function* kind (reward, advantage, policy loss, ...) is called ``fn(*inputs, **args)`` with
  ``inputs`` leading positional values of the host's; a *factory* kind is called
  ``factory(ctx, **args)`` with ``ctx`` an instance of the call's ``context`` class, and what it
  returns must implement the call's ``protocol`` (a weight transport has two factories, its
  ``sender`` and its ``receiver``). ``args`` are always the job's ``*_args`` table for the
  component (:class:`~.refs.ComponentRef`).

The host binds every component through this table (``ComponentRegistry.bind``), so a kind's
facts live here and nowhere else; the hooks themselves are declared in :mod:`.hookspecs`, which
pluggy registers.
"""

from __future__ import annotations

import attrs

from .contexts import (
    BuildContext,
    EngineRouterContext,
    LoggerContext,
    SchedulerContext,
    TeacherContext,
    TeacherManagerContext,
    WeightTransportContext,
)
from .protocols import (
    Agent,
    EngineContext,
    EngineRouter,
    MetricsLogger,
    RolloutEngine,
    RouterMiddleware,
    SandboxProvider,
    Scheduler,
    Teacher,
    TeacherRouter,
    TrainWorker,
    TrainWorkerContext,
    WeightReceiver,
    WeightSender,
)
from .specs import (
    AdvantageSpec,
    AgentSpec,
    AggregationSpec,
    ComponentSpec,
    CorrectionSpec,
    DataSourceSpec,
    EngineRouterSpec,
    FilterSpec,
    KLSpec,
    LoggerSpec,
    PolicyLossSpec,
    RewardSpec,
    RolloutEngineSpec,
    RouterMiddlewareSpec,
    SandboxSpec,
    SchedulerSpec,
    TeacherManagerSpec,
    TeacherSpec,
    TrainBackendSpec,
    WeightTransportSpec,
)


@attrs.define(frozen=True)
class Call:
    """How the host calls one callable field of a kind's spec.

    ``field``: the spec attribute (``fn``, ``factory``, ``sender``, ``receiver``). A factory has a
    ``context`` (the class of the ``ctx`` it receives first) and, when the host checks what it
    builds, a ``protocol``; a function has ``inputs``, the number of leading positional values the
    host passes (a reward's trajectory; an aggregation's loss, mask and norm). ``reserved``: the
    keywords the host itself fills at call time (a reward's ``sandbox``), which a job file may not
    set.
    """

    field: str
    context: type[BuildContext] | None = None
    protocol: type | None = None
    inputs: int = 0
    reserved: tuple[str, ...] = ()

    @property
    def is_factory(self) -> bool:
        """Whether the host builds an object with it (``factory(ctx, **args)``) rather than calling
        a function on its inputs."""
        return self.context is not None

    @property
    def positional(self) -> int:
        """The leading positional parameters the host fills: the context, or the inputs."""
        return 1 if self.is_factory else self.inputs


@attrs.define(frozen=True)
class Kind:
    """One component kind: the job-file word, its hook's name, its spec class and how its spec's
    callables are called (the first of ``calls`` is the default)."""

    name: str
    hook: str
    spec: type[ComponentSpec]
    calls: tuple[Call, ...]

    def call(self, field: str | None = None) -> Call:
        """The :class:`Call` of ``field`` (default: the kind's first); a field the kind does not
        call is the host's own bug: a ``TypeError``."""
        if field is None:
            return self.calls[0]
        for call in self.calls:
            if call.field == field:
                return call
        raise TypeError(f"{self.name} specs have no callable field '{field}' the host calls; "
                        f"they have: {', '.join(c.field for c in self.calls)}")

    @property
    def is_factory(self) -> bool:
        """Whether the kind's components are built objects (else functions the host calls)."""
        return self.calls[0].is_factory


def _fn(inputs: int, *reserved: str) -> tuple[Call, ...]:
    return (Call("fn", inputs=inputs, reserved=reserved),)


def _factory(context: type[BuildContext], protocol: type | None = None) -> tuple[Call, ...]:
    return (Call("factory", context=context, protocol=protocol),)


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("agent", "loongsage_agents", AgentSpec, _factory(BuildContext, Agent)),
        Kind("reward", "loongsage_rewards", RewardSpec, _fn(1, "sandbox")),
        Kind("data_source", "loongsage_data_sources", DataSourceSpec, _factory(BuildContext)),
        Kind("sandbox", "loongsage_sandboxes", SandboxSpec, _factory(BuildContext, SandboxProvider)),
        Kind("advantage", "loongsage_advantages", AdvantageSpec, _fn(1)),
        Kind("policy_loss", "loongsage_policy_losses", PolicyLossSpec, _fn(1)),
        Kind("kl", "loongsage_kls", KLSpec, _fn(1)),
        Kind("loss_aggregation", "loongsage_loss_aggregations", AggregationSpec, _fn(3)),
        Kind("correction", "loongsage_corrections", CorrectionSpec, _fn(1)),
        Kind("router_middleware", "loongsage_router_middlewares", RouterMiddlewareSpec,
             _factory(BuildContext, RouterMiddleware)),
        Kind("filter", "loongsage_filters", FilterSpec, _fn(1)),
        Kind("scheduler", "loongsage_schedulers", SchedulerSpec, _factory(SchedulerContext, Scheduler)),
        Kind("teacher", "loongsage_teachers", TeacherSpec, _factory(TeacherContext, Teacher)),
        Kind("teacher_manager", "loongsage_teacher_managers", TeacherManagerSpec,
             _factory(TeacherManagerContext, TeacherRouter)),
        Kind("weight_transport", "loongsage_weight_transports", WeightTransportSpec,
             (Call("sender", context=WeightTransportContext, protocol=WeightSender),
              Call("receiver", context=WeightTransportContext, protocol=WeightReceiver))),
        Kind("logger", "loongsage_loggers", LoggerSpec, _factory(LoggerContext, MetricsLogger)),
        Kind("train_backend", "loongsage_train_backends", TrainBackendSpec,
             _factory(TrainWorkerContext, TrainWorker)),
        Kind("rollout_engine", "loongsage_rollout_engines", RolloutEngineSpec,
             _factory(EngineContext, RolloutEngine)),
        Kind("engine_router", "loongsage_engine_routers", EngineRouterSpec,
             _factory(EngineRouterContext, EngineRouter)),
    )
}
"""Every component kind, in the order ``loongsage plugins`` lists them."""


def kind_of(spec: ComponentSpec) -> Kind:
    """The kind whose spec class ``spec`` is an instance of (exactly, not a subclass of another's)."""
    for kind in KINDS.values():
        if type(spec) is kind.spec:
            return kind
    raise TypeError(f"{spec!r} is not a spec of any component kind")
