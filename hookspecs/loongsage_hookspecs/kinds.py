"""The component kinds of the LoongSage contract: the :data:`KINDS` table.

Each kind is the word a job file and ``loongsage plugins`` use (``reward``, ``train_backend``,
...), the name of the provider hook in :mod:`.hookspecs` that yields its specs, and the spec class
those are. The host indexes the specs it collects by kind with this table, and lists the kinds in
its order; the hooks themselves are declared in :mod:`.hookspecs`, which pluggy registers.
"""

from __future__ import annotations

import attrs

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
class Kind:
    """One component kind: the job-file word, its hook's name and its spec class."""

    name: str
    hook: str
    spec: type[ComponentSpec]


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("agent", "loongsage_agents", AgentSpec),
        Kind("reward", "loongsage_rewards", RewardSpec),
        Kind("data_source", "loongsage_data_sources", DataSourceSpec),
        Kind("sandbox", "loongsage_sandboxes", SandboxSpec),
        Kind("advantage", "loongsage_advantages", AdvantageSpec),
        Kind("policy_loss", "loongsage_policy_losses", PolicyLossSpec),
        Kind("kl", "loongsage_kls", KLSpec),
        Kind("loss_aggregation", "loongsage_loss_aggregations", AggregationSpec),
        Kind("correction", "loongsage_corrections", CorrectionSpec),
        Kind("router_middleware", "loongsage_router_middlewares", RouterMiddlewareSpec),
        Kind("filter", "loongsage_filters", FilterSpec),
        Kind("scheduler", "loongsage_schedulers", SchedulerSpec),
        Kind("teacher", "loongsage_teachers", TeacherSpec),
        Kind("teacher_manager", "loongsage_teacher_managers", TeacherManagerSpec),
        Kind("weight_transport", "loongsage_weight_transports", WeightTransportSpec),
        Kind("logger", "loongsage_loggers", LoggerSpec),
        Kind("train_backend", "loongsage_train_backends", TrainBackendSpec),
        Kind("rollout_engine", "loongsage_rollout_engines", RolloutEngineSpec),
        Kind("engine_router", "loongsage_engine_routers", EngineRouterSpec),
    )
}
"""Every component kind, in the order ``loongsage plugins`` lists them."""
