"""Resolving a job: every component the job file names, looked up in the plugin host.

``resolve_job`` is what ``loongsage validate`` runs and what ``loongsage run`` runs first (for a job
with an ``[sft]`` table, ``resolve_sft_job``, which ``loongsage sft`` runs first): it
fails on the first unknown name with the job-file key at fault and the list of choices, on
settings that would do nothing, and on component arguments the component does not take
(:mod:`loongsage_core.component_args`).
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs

from loongsage_hookspecs import ComponentRef, LoadsWeights, SchedulerSpec, SourcePicker

from .algorithms.distill import distill_setup
from .component_args import check_component_args, check_effective_settings
from .config import ConfigError, JobConfig, component_refs
from .plugins import PluginHost
from .signal_checks import check_training_signal
from .validation import check_job


@attrs.define
class ResolvedJob:
    """The job, the host, and every component it names as ``key -> (kind, name, provider)``."""

    job: JobConfig
    host: PluginHost
    components: dict[str, tuple[str, str, str]] = attrs.field(factory=dict)

    def summary(self) -> dict[str, Any]:
        return {key: {"kind": kind, "name": name, "plugin": plugin}
                for key, (kind, name, plugin) in self.components.items()}


def record_components(resolved: ResolvedJob, refs: Iterable[ComponentRef]) -> None:
    """Look every component of ``refs`` up (an unknown name fails with its job-file key and the
    choices) and note it in ``resolved.components`` under its key."""
    where = resolved.job.source_path or "<job>"
    for ref in refs:
        resolved.host.get(ref.kind, ref.name, where=ref.where)
        key = ref.where.removeprefix(f"{where}: ")
        resolved.components[key] = (ref.kind, ref.name, resolved.host.provider(ref.kind, ref.name))


def check_sources(job: JobConfig, where: str, hint: str) -> None:
    """At least one ``[[data]]`` source; each with exactly one of path / generator and its own name.
    ``hint`` says in the error what a source needs (RL and SFT jobs differ). The ``[[eval.data]]``
    sources likewise (none is needed), and they distil nothing."""
    if not job.data:
        raise ConfigError(f"{where}: no [[data]] source: add at least one {hint}")
    for key, sources in (("data", job.data), ("eval.data", job.eval.data)):
        names: set[str] = set()
        for i, src in enumerate(sources):
            if bool(src.path) == bool(src.generator):
                raise ConfigError(f"{where}: {key}[{i}] ('{src.name}'): set exactly one of 'path' or 'generator'")
            if src.name in names:
                raise ConfigError(f"{where}: {key}[{i}].name: duplicate data source name '{src.name}'")
            names.add(src.name)
    for i, src in enumerate(job.eval.data):
        if src.teacher:
            raise ConfigError(f"{where}: eval.data[{i}].teacher: an evaluation trains nothing, so it distils from "
                              "no teacher; remove the key")


def check_references(job: JobConfig) -> None:
    """Cross-field checks that the schema alone cannot express."""
    where = job.source_path or "<job>"
    check_sources(job, where, "with a 'path' or a 'generator'")
    teachers = {t.name for t in job.teachers}
    for i, src in enumerate(job.data):
        if src.teacher and src.teacher not in teachers:
            listing = ", ".join(sorted(teachers)) or "none defined in [[teachers]]"
            raise ConfigError(f"{where}: data[{i}].teacher: unknown teacher '{src.teacher}'; choose one of: {listing}")
    for section, listed_key, args_key in (("algorithm", "corrections", "correction_args"),
                                          ("algorithm", "filters", "filter_args"),
                                          ("agentflow", "middleware", "middleware_args")):
        listed = set(getattr(getattr(job, section), listed_key))
        for name in getattr(getattr(job, section), args_key):
            if name not in listed:
                raise ConfigError(f"{where}: {section}.{args_key}.{name}: '{name}' is not listed in "
                                  f"{section}.{listed_key}")
    check_job(job)
    for i, src in enumerate(job.data):
        for name in src.reward_args:
            if name not in src.reward:
                raise ConfigError(f"{where}: data[{i}].reward_args.{name}: '{name}' is not listed in data[{i}].reward")


def check_lora_support(job: JobConfig, host: PluginHost) -> None:
    """``[train] lora`` needs a train backend and a rollout engine that declare ``supports_lora``."""
    if job.train.lora is None:
        return
    where = job.source_path or "<job>"
    for key, kind, name in (("train.backend", "train_backend", job.train.backend),
                            ("rollout.engine", "rollout_engine", job.rollout.engine)):
        if not host.get(kind, name).supports_lora:
            raise ConfigError(f"{where}: train.lora: {key} = '{name}' does not support LoRA adapters "
                              f"(its {kind} spec does not declare supports_lora); drop [train] lora or pick "
                              "one that does (torch)")


def check_model_dtype(job: JobConfig, host: PluginHost) -> None:
    """``[model] dtype`` must be one the train backend trains in (its spec's ``model_dtypes``)."""
    spec = host.get("train_backend", job.train.backend)
    allowed = tuple(getattr(spec, "model_dtypes", ()))
    if allowed and job.model.dtype not in allowed:
        raise ConfigError(f"{job.source_path or '<job>'}: model.dtype = '{job.model.dtype}': train.backend = "
                          f"'{job.train.backend}' trains in {', '.join(repr(d) for d in allowed)} only (its "
                          f"train_backend spec declares model_dtypes); set model.dtype = '{allowed[0]}'")


def check_backend_job(job: JobConfig, host: PluginHost) -> None:
    """The train backend's own checks of the job (its spec's ``check_job``): its ``backend_args``,
    the model and the parallel layout, refused here with the reason rather than when a worker
    starts on the cluster."""
    check = host.get("train_backend", job.train.backend).check_job
    if check is None:
        return
    try:
        check(job)
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"{job.source_path or '<job>'}: train.backend = '{job.train.backend}': {exc}") from None


def check_engine_job(job: JobConfig, host: PluginHost) -> None:
    """The rollout engine's own checks of ``[rollout] engine_args`` (its spec's ``check_job``),
    refused here with the key at fault rather than when an engine actor starts."""
    check = host.get("rollout_engine", job.rollout.engine).check_job
    if check is None:
        return
    try:
        check(job)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{job.source_path or '<job>'}: rollout.engine = '{job.rollout.engine}': {exc}") from None


def check_weight_transport(job: JobConfig, host: PluginHost) -> None:
    """A transport that declares ``colocated_only`` needs ``[placement] colocate = true``."""
    name = job.rollout.weight_transport
    if not job.placement.colocate and host.get("weight_transport", name).colocated_only:
        raise ConfigError(f"{job.source_path or '<job>'}: rollout.weight_transport = '{name}' hands weights over "
                          "inside one process (its spec declares colocated_only), so it needs placement.colocate "
                          "= true; pick a transport between processes (shm, broadcast, auto)")


def check_reference_updates(job: JobConfig, host: PluginHost) -> None:
    """``[algorithm] ref_update_every`` copies the policy into the reference model, which needs a
    train backend that declares the :class:`~loongsage_hookspecs.LoadsWeights` capability."""
    if job.algorithm.ref_update_every and not host.get("train_backend", job.train.backend).declares(LoadsWeights):
        raise ConfigError(f"{job.source_path or '<job>'}: algorithm.ref_update_every: train.backend = "
                          f"'{job.train.backend}' does not declare the LoadsWeights capability, so its reference "
                          "model cannot take the policy's weights; set ref_update_every = 0")


def check_async_scheduler(job: JobConfig, host: PluginHost) -> SchedulerSpec:
    """The ``[async]`` scheduler's spec, if it can run the job: the per-source quotas come from the
    ``[[data]]`` weights (never from ``scheduler_args``), and more than one data source needs a
    scheduler that declares the :class:`~loongsage_hookspecs.SourcePicker` capability."""
    where = job.source_path or "<job>"
    spec: SchedulerSpec = host.get("scheduler", job.async_.scheduler, where=f"{where}: async.scheduler")
    if "quota" in job.async_.scheduler_args:
        raise ConfigError(f"{where}: async.scheduler_args.quota: the quotas come from the [[data]] weights; "
                          "remove it")
    if len(job.data) > 1 and not spec.declares(SourcePicker):
        raise ConfigError(f"{where}: async.scheduler: '{job.async_.scheduler}' does not declare the SourcePicker "
                          f"capability (a per-source 'quota'), so it cannot keep the shares of the job's "
                          f"{len(job.data)} data sources")
    return spec


def resolve_job(job: JobConfig, host: PluginHost | None = None) -> ResolvedJob:
    """Load the job's plugins (unless given) and resolve every named component."""
    check_references(job)
    host = host or PluginHost.from_job(job)
    where = job.source_path or "<job>"
    resolved = ResolvedJob(job=job, host=host)
    record_components(resolved, component_refs(job))
    for i, src in enumerate(job.data):
        agent_spec = host.get("agent", src.agent, where=f"{where}: data[{i}].agent")
        check = agent_spec.check_args
        if check is not None:
            try:
                check(**dict(src.agent_args))
            except (ValueError, TypeError, OSError) as exc:
                raise ConfigError(f"{where}: data[{i}].agent_args: {exc}") from None
        if agent_spec.preflight is not None:  # the agent's program starts where it will run (its sandbox)
            try:
                agent_spec.preflight(dict(src.agent_args), src.sandbox, dict(src.sandbox_args))
            except (ValueError, TypeError, OSError) as exc:
                raise ConfigError(f"{where}: data[{i}].agent: {exc}") from None

    distill_setup(job, host)  # distillation settings that do not fit together fail here, not mid-run
    check_lora_support(job, host)
    check_model_dtype(job, host)
    check_backend_job(job, host)
    check_engine_job(job, host)
    check_reference_updates(job, host)
    check_weight_transport(job, host)
    if job.async_.enable:
        check_async_scheduler(job, host)
    check_effective_settings(job)
    check_training_signal(job, host)  # zero-signal settings refused, misfit ones warned of
    check_component_args(job, host)  # a misspelt *_args key is a config error, not a run of failures
    return resolved


SFT_KINDS = ("train_backend", "logger", "data_source")
"""The kinds of component a supervised job uses (the rest of an RL job's tables are ignored)."""


def resolve_sft_job(job: JobConfig, host: PluginHost | None = None) -> ResolvedJob:
    """Check a supervised job (``[sft]`` table): its data sources, sizes and model, and resolve the
    components it uses (train backend, loggers, data source plugins). RL-only tables are ignored."""
    from .validation import check_data_files, check_models

    where = job.source_path or "<job>"
    check_sources(job, where, "with a 'path' to chat data")
    if job.train.num_workers != 1:
        raise ConfigError(f"{where}: train.num_workers = {job.train.num_workers}: loongsage sft trains in one "
                          "process; set it to 1")
    if job.train.micro_batch_size > job.train.mini_batch_size:
        raise ConfigError(f"{where}: train.micro_batch_size ({job.train.micro_batch_size}) is larger than "
                          f"train.mini_batch_size ({job.train.mini_batch_size})")
    check_models(job)
    check_data_files(job)
    host = host or PluginHost.from_job(job)
    resolved = ResolvedJob(job=job, host=host)
    record_components(resolved, component_refs(job, kinds=SFT_KINDS))
    check_model_dtype(job, host)
    check_backend_job(job, host)
    if job.train.lora is not None and not host.get("train_backend", job.train.backend).supports_lora:
        raise ConfigError(f"{where}: train.lora: train.backend = '{job.train.backend}' does not support LoRA "
                          "adapters (its train_backend spec does not declare supports_lora); drop [train] lora "
                          "or pick one that does (torch)")
    return resolved
