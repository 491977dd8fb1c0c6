"""Checking every component's ``*_args`` table at validate time, and settings that would do nothing.

A component receives its job-file arguments as keyword arguments (``fn(inputs, **args)`` or
``factory(ctx, **args)``, ``ctx`` the kind's context). A misspelt key would otherwise surface
mid-run (a reward that raises on every trajectory marks each one failed; a loss that raises stops
the first step), so
``loongsage validate`` (and ``run``, which resolves first) compares each table with what the
component accepts: the spec's ``args_schema`` (an attrs class) when it declares one, else the
signature of its function or factory (``inspect.signature``), leaving out the leading positional
inputs the host passes (a factory's context, a function's inputs) and the keywords the host fills
itself. A signature with ``**kwargs``
accepts any key. Required arguments without a default must be given.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator, Mapping

import attrs

from .config import ConfigError, JobConfig, structure_args

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_CTX = 1
"""A factory's leading positional input: its context (``factory(ctx, **args)``)."""


@attrs.define(frozen=True)
class ArgsTable:
    """One ``*_args`` table: its job-file key, the component it goes to, and how the host calls it."""

    key: str
    kind: str
    name: str
    args: Mapping[str, Any]
    positional: int = 0
    """Leading positional inputs the host passes (``inputs``, ``trajectory``, ``loss, mask, norm``;
    a factory's context: :data:`_CTX`)."""
    reserved: tuple[str, ...] = ()
    """Keywords the host fills itself (a job file may not set them)."""
    attr: str = "fn"
    """The spec attribute that is called (``fn``, ``factory`` or ``sender``)."""


def args_tables(job: JobConfig) -> Iterator[ArgsTable]:
    """Every component argument table of ``job`` with a name to check it against."""
    alg = job.algorithm
    yield ArgsTable("algorithm.advantage_args", "advantage", alg.advantage, alg.advantage_args, 1)
    yield ArgsTable("algorithm.policy_loss_args", "policy_loss", alg.policy_loss, alg.policy_loss_args, 1)
    yield ArgsTable("algorithm.loss_agg_args", "loss_aggregation", alg.loss_agg, alg.loss_agg_args, 3)
    if alg.kl:
        yield ArgsTable("algorithm.kl_args", "kl", alg.kl, alg.kl_args, 1)
    if alg.distill_kl:
        yield ArgsTable("algorithm.distill_kl_args", "kl", alg.distill_kl, alg.distill_kl_args, 1)
    for name in alg.corrections:
        yield ArgsTable(f"algorithm.correction_args.{name}", "correction", name, alg.correction_args.get(name, {}), 1)
    for name in alg.filters:
        yield ArgsTable(f"algorithm.filter_args.{name}", "filter", name, alg.filter_args.get(name, {}), 1)
    for i, src in enumerate(job.data):
        for name in src.reward:
            yield ArgsTable(f"data[{i}].reward_args.{name}", "reward", name, src.reward_args.get(name, {}), 1,
                            reserved=("sandbox",))
        yield ArgsTable(f"data[{i}].agent_args", "agent", src.agent, src.agent_args, _CTX, attr="factory")
        if src.generator:
            yield ArgsTable(f"data[{i}].generator_args", "data_source", src.generator, src.generator_args, _CTX,
                            attr="factory")
        if src.sandbox:
            yield ArgsTable(f"data[{i}].sandbox_args", "sandbox", src.sandbox, src.sandbox_args, _CTX,
                            attr="factory")
    for name in job.agentflow.middleware:
        yield ArgsTable(f"agentflow.middleware_args.{name}", "router_middleware", name,
                        job.agentflow.middleware_args.get(name, {}), _CTX, attr="factory")
    if job.async_.enable:
        yield ArgsTable("async.scheduler_args", "scheduler", job.async_.scheduler, job.async_.scheduler_args, _CTX,
                        attr="factory")
    for i, lg in enumerate(job.loggers):
        yield ArgsTable(f"loggers[{i}].args", "logger", lg.name, lg.args, _CTX, attr="factory")
    for i, t in enumerate(job.teachers):
        yield ArgsTable(f"teachers[{i}].args", "teacher", t.backend, t.args, _CTX, reserved=("path",),
                        attr="factory")
    if job.rollout.engine_router:
        yield ArgsTable("rollout.engine_router_args", "engine_router", job.rollout.engine_router,
                        job.rollout.engine_router_args, _CTX, attr="factory")
    yield ArgsTable("rollout.weight_transport_args", "weight_transport", job.rollout.weight_transport,
                    job.rollout.weight_transport_args, _CTX, attr="sender")


def transport_tables(job: JobConfig, host: Any) -> Iterator[ArgsTable]:
    """The per-transport tables of a transport whose spec declares ``args_per_transport`` (``auto``):
    each key must name an active transport it may choose (one with an ``auto_rank``) and hold a
    table, checked as that transport's own ``weight_transport_args``."""
    where = job.source_path or "<job>"
    args = job.rollout.weight_transport_args
    if not args or not host.get("weight_transport", job.rollout.weight_transport).args_per_transport:
        return
    choices = sorted(name for name, spec in host.components("weight_transport").items() if spec.auto_rank)
    for name, table in args.items():
        key = f"rollout.weight_transport_args.{name}"
        if name not in choices:
            raise ConfigError(f"{where}: {key}: '{job.rollout.weight_transport}' takes one table per transport it "
                              f"may choose, and '{name}' is none of them; choose from: {', '.join(choices)}")
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}: {key}: expected a table of the '{name}' transport's arguments, got "
                              f"{type(table).__name__}")
        yield ArgsTable(key, "weight_transport", name, table, _CTX, attr="sender")


def accepted_args(target: Callable[..., Any], positional: int = 0,
                  reserved: tuple[str, ...] = ()) -> tuple[list[str], list[str]] | None:
    """``(accepted, required)`` keyword names of ``target`` after its first ``positional``
    positional parameters, less ``reserved``; ``None`` when it takes any keyword (``**kwargs``)
    or has no readable signature."""
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    accepted: list[str] = []
    required: list[str] = []
    skipped = 0
    for p in params:
        if p.kind in _POSITIONAL and skipped < positional:
            skipped += 1
            continue
        if p.kind in _KEYWORD and p.name not in reserved:
            accepted.append(p.name)
            if p.default is inspect.Parameter.empty:
                required.append(p.name)
    return accepted, required


def check_component_args(job: JobConfig, host: Any) -> None:
    """Raise :class:`ConfigError` naming the key of the first argument table that does not fit
    its component: an unknown key (with the accepted ones) or a missing required argument."""
    where = job.source_path or "<job>"
    for table in (*args_tables(job), *transport_tables(job, host)):
        spec = host.get(table.kind, table.name, where=f"{where}: {table.key}")
        schema = spec.args_schema
        if schema is not None:
            fields = attrs.fields(schema)
            found: tuple[list[str], list[str]] | None = (
                [f.name for f in fields], [f.name for f in fields if f.default is attrs.NOTHING])
        else:
            target = getattr(spec, table.attr, None)
            found = accepted_args(target, table.positional, table.reserved) if callable(target) else None
        if found is None:
            continue
        accepted, required = found
        what = f"{table.kind.replace('_', ' ')} '{table.name}'"
        for key in table.args:
            if key not in accepted:
                listing = ", ".join(accepted) or "none"
                raise ConfigError(f"{where}: {table.key}.{key}: unknown argument of {what}; it takes: {listing}")
        missing = [r for r in required if r not in table.args]
        if missing:
            raise ConfigError(f"{where}: {table.key}: {what} needs the argument(s) {', '.join(missing)}")
        if schema is not None:  # the values too: the schema's field validators
            try:
                structure_args(schema, table.args, f"{where}: {table.key}", what)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None


def check_effective_settings(job: JobConfig) -> None:
    """Refuse settings that would be accepted and silently do nothing."""
    where = job.source_path or "<job>"
    alg = job.algorithm
    if alg.kl_in_reward and not alg.kl:
        raise ConfigError(f"{where}: algorithm.kl_in_reward = true but algorithm.kl is not set; name a KL estimator "
                          "(e.g. kl = 'k1') or drop kl_in_reward")
    if alg.kl_in_reward and alg.kl_coef == 0.0 and not any(src.teacher for src in job.data):
        raise ConfigError(f"{where}: algorithm.kl_in_reward = true with algorithm.kl_coef = 0 folds nothing into "
                          "the reward; set kl_coef > 0")
    if alg.kl_args and not alg.kl:
        raise ConfigError(f"{where}: algorithm.kl_args is set but algorithm.kl is not; the arguments would go nowhere")
    if (alg.distill_in_reward or alg.distill_kl_args) and not alg.distill_kl:
        keys = [k for k, v in (("distill_in_reward", alg.distill_in_reward), ("distill_kl_args", alg.distill_kl_args))
                if v]
        raise ConfigError(f"{where}: algorithm.{keys[0]} is set but algorithm.distill_kl is not; name a "
                          "distillation term or drop it")
    if alg.distill_kl and not any(src.teacher for src in job.data):
        raise ConfigError(f"{where}: algorithm.distill_kl = '{alg.distill_kl}' but no [[data]] source names a "
                          "teacher, so no row is distilled; set data[i].teacher")
    if alg.max_filter_retries > 0 and not alg.filters:
        raise ConfigError(f"{where}: algorithm.max_filter_retries = {alg.max_filter_retries} but algorithm.filters "
                          "is empty; nothing is ever dropped, so nothing is refilled")
