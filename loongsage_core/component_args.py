"""Checking every component's ``*_args`` table at validate time, and settings that would do nothing.

A component receives its job-file arguments as keyword arguments (``fn(inputs, **args)`` or
``factory(ctx, **args)``, ``ctx`` the kind's context). A misspelt key or a value of the wrong type
would otherwise surface mid-run (a reward that raises on every trajectory marks each one failed; a
loss that raises stops the first step), so ``loongsage validate`` (and ``run``, which resolves
first) binds every component's arguments the way the run will, without calling anything
(:func:`loongsage_core.binding.check_arguments`): the spec's ``args_schema`` when it declares one,
else the callable's own signature and annotations.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import attrs

from loongsage_hookspecs import ComponentRef

from .config import ConfigError, JobConfig, component_ref, component_refs


def transport_refs(job: JobConfig, host: Any) -> Iterator[ComponentRef]:
    """The per-transport tables of a transport whose spec declares ``args_per_transport`` (``auto``):
    each key must name an active transport it may choose (one with an ``auto_rank``) and hold a
    table, checked as that transport's own ``weight_transport_args``."""
    where = job.source_path or "<job>"
    args = job.rollout.weight_transport_args
    if not args or not host.get("weight_transport", job.rollout.weight_transport).args_per_transport:
        return
    choices = sorted(name for name, spec in host.components("weight_transport").items() if spec.auto_rank)
    base = component_ref(job, "rollout.weight_transport")
    for name, table in args.items():
        key = f"rollout.weight_transport_args.{name}"
        if name not in choices:
            raise ConfigError(f"{where}: {key}: '{job.rollout.weight_transport}' takes one table per transport it "
                              f"may choose, and '{name}' is none of them; choose from: {', '.join(choices)}")
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}: {key}: expected a table of the '{name}' transport's arguments, got "
                              f"{type(table).__name__}")
        yield attrs.evolve(base, name=name, args=table, args_where=f"{where}: {key}")


def check_component_args(job: JobConfig, host: Any) -> None:
    """Raise :class:`ConfigError` naming the key of the first argument table that does not fit
    its component: an unknown key (with the accepted ones), a missing required argument, or a
    value of the wrong type or range."""
    for ref in component_refs(job):
        host.check_arguments(ref)
    for ref in transport_refs(job, host):
        host.check_arguments(ref)


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
