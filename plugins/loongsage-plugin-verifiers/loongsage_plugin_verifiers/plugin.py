"""Hook implementations of loongsage-plugin-verifiers (the module its entry point names).

Only names and argument schemas live here; verifiers (a few seconds to import) is imported when a
component is first built or checked.
"""

from __future__ import annotations

from typing import Any, Iterator

import attrs

from loongsage_hookspecs import AgentSpec, BuildContext, DataSourceSpec, RewardSpec, hookimpl


def _table(_inst: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{attribute.name} must be a table, got {value!r}")


@attrs.define(kw_only=True)
class SourceArgs:
    """``generator_args`` of the ``verifiers`` data source. Building it loads the environment, so
    ``loongsage validate`` refuses one that is missing or broken, naming the key."""

    env: str
    """The verifiers environment: its taskset package (installed, or a module on the path)."""
    env_args: dict[str, Any] = attrs.field(factory=dict, validator=_table)
    """The rest of its ``[env]`` table: ``taskset`` settings, seats (``agent = {max_turns = 4}``), ..."""
    split: str = "train"
    """``"train"`` or ``"eval"``: sets the taskset's ``split`` setting (a taskset without one has
    only ``"train"``; hold tasks out with ``select`` instead)."""
    select: dict[str, Any] = attrs.field(factory=dict, validator=_table)
    """verifiers' task selection: ``include`` / ``exclude`` (``idx`` ranges, ``ids``, ``names``),
    ``shuffle``, ``seed``, ``skip``, ``limit``."""
    num_samples: int | None = None
    """At most this many tasks (required for an infinite taskset)."""
    seed: int = 0
    """The run's seed (the host passes it; verifiers' ``select.seed`` orders a shuffle)."""

    def __attrs_post_init__(self) -> None:
        from .envs import load_env, split_args

        if self.num_samples is not None and self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        load_env(self.env, split_args(self.env, self.env_args, self.split))


def _source(ctx: BuildContext, *, env: str, env_args: dict[str, Any] | None = None, split: str = "train",
            select: dict[str, Any] | None = None, num_samples: int | None = None,
            seed: int = 0) -> list[dict[str, Any]]:
    from .envs import task_rows

    return task_rows(env, env_args or {}, split=split, select=select, num_samples=num_samples)


def _agent(ctx: BuildContext, **args: Any) -> Any:
    from .agent import VerifiersAgent

    return VerifiersAgent(**args)


def _check_agent(**args: Any) -> None:
    from .agent import check_agent_args

    check_agent_args(**args)


def _reward(trajectory: Any) -> Any:
    from .outcome import verifiers_reward

    return verifiers_reward(trajectory)


@attrs.define(kw_only=True)
class AgentArgs:
    """``agent_args`` of the ``verifiers`` agent."""

    env: str | None = None
    """The environment to play (default: the one the row's ``verifiers`` source read)."""
    env_args: dict[str, Any] = attrs.field(factory=dict, validator=_table)
    """Its ``[env]`` table (seats, harnesses, limits), as for the data source."""
    model: str = "policy"
    """The model name the seats send to the router."""


@hookimpl
def loongsage_data_sources() -> Iterator[DataSourceSpec]:
    yield DataSourceSpec(name="verifiers", factory=_source, args_schema=SourceArgs,
                         description="a verifiers environment's tasks (its taskset, a split, a select) as rows")


@hookimpl
def loongsage_agents() -> Iterator[AgentSpec]:
    yield AgentSpec(name="verifiers", factory=_agent, args_schema=AgentArgs, check_args=_check_agent,
                    description="one episode of the row's verifiers environment: its Env.run, harness, limits "
                                "and scoring, every model call through the trajectory's endpoint")


@hookimpl
def loongsage_rewards() -> Iterator[RewardSpec]:
    yield RewardSpec(name="verifiers", fn=_reward,
                     description="the verifiers environment's score of the episode (its reward functions "
                                 "weighted and summed), each reward and metric function as a detail")
