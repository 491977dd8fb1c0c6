"""The ``verifiers`` agent: a trajectory is one episode of a verifiers environment.

For each trajectory the agent rebuilds the row's task (its wire data, in the taskset's own task
type) and plays one episode of it with the environment's own code: ``Env.run`` (which seats play
and how they interact: one agent run, a turn-by-turn game, several seats), each seat's harness
program, the environment's limits (``max_turns``, token caps, ``@vf.stop`` predicates) and, after
the run, the task's ``@vf.reward`` / ``@vf.metric`` scoring and ``Env.finalize``. Every model call
of the episode goes, through verifiers' interception server, to the trajectory's endpoint on the
AgentFlow router (``ctx.base_url`` with ``ctx.api_key``), which records it token for token.

Sampling: the episode's model context carries the run's sampling (``temperature``, ``top_p``,
``max_tokens`` from the source's settings); each seat's own ``sampling`` in the environment merges
over it, as in verifiers. A training run locks the policy's sampling at the router, so there a
seat's ``temperature`` is recorded but the job's is used, and its ``max_tokens`` caps a turn
below the job's ``max_new_tokens``.

The result: the trainable seat's conversation as chat messages, its last reply as the response,
and in ``metadata["verifiers"]`` the episode's outcome (rewards, metrics, stop condition, errors)
for the ``verifiers`` reward. A seat that is not trainable but samples the trajectory's endpoint
(its model and client are the run's) would have its turns trained on, so such an episode fails
with a message saying to give that seat a model of its own.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Mapping

import attrs

from loongsage_hookspecs import AgentContext, AgentResult

from .envs import ROW_KEY, check_env, env_key, load_env, rebuild_task
from .host import env_host
from .outcome import episode_outcome

KEY_VAR_PREFIX = "LOONGSAGE_VF_API_KEY_"
"""verifiers reads an endpoint's key from an environment variable; each trajectory gets its own
(named with ``API_KEY`` so verifiers' subprocess runtimes do not pass it to harness programs)."""


@attrs.define
class VerifiersAgent:
    """Plays one verifiers episode per trajectory (see the module doc).

    Args:
        env: the environment (its taskset package); default: the one the row's data source read.
        env_args: the rest of its ``[env]`` table (seats, harnesses, limits, taskset settings).
        model: the model name the seats send (any name reaches the policy).
    """

    env: str | None = None
    env_args: dict[str, Any] = attrs.field(factory=dict)
    model: str = "policy"

    def _environment(self, row: Mapping[str, Any]) -> tuple[str, Any]:
        env = self.env or row.get("env")
        if not env:
            raise ValueError("the 'verifiers' agent needs agent_args.env, or rows of the 'verifiers' data source")
        if self.env and row.get("env") and row["env"] != self.env:
            raise ValueError(f"the row comes from verifiers environment {row['env']!r} but agent_args.env is "
                             f"{self.env!r}")
        args = self.env_args if self.env else dict(row.get("env_args") or {})
        return env_key(env, args), load_env(env, args)

    async def run(self, ctx: AgentContext) -> AgentResult:
        import verifiers.v1 as vf

        row = ctx.metadata.get(ROW_KEY)
        if not isinstance(row, Mapping) or not isinstance(row.get("task"), Mapping):
            raise ValueError(f"trajectory {ctx.trajectory_id}: the 'verifiers' agent plays rows of the 'verifiers' "
                             f"data source (metadata['{ROW_KEY}']['task']); this row has none")
        key, environment = self._environment(row)
        task = rebuild_task(environment, row["task"])
        var = KEY_VAR_PREFIX + secrets.token_hex(8)
        os.environ[var] = ctx.api_key or "loongsage"
        try:
            client = vf.EvalClientConfig(base_url=ctx.base_url, api_key_var=var)
            model_ctx = vf.ModelContext(model=self.model, client=client, sampling=_sampling(ctx.sampling))
            episode = await env_host().run_episode(key, environment, task, model_ctx)
        finally:
            os.environ.pop(var, None)
        return episode_outcome(episode, ctx.base_url)


def _sampling(sampling: Mapping[str, Any]) -> Any:
    """The run's sampling settings (SGLang names) as a verifiers ``SamplingConfig``."""
    import verifiers.v1 as vf

    values = {"temperature": sampling.get("temperature"), "top_p": sampling.get("top_p"),
              "max_tokens": sampling.get("max_new_tokens")}
    return vf.SamplingConfig(**{k: v for k, v in values.items() if v is not None})


def check_agent_args(env: str | None = None, env_args: dict[str, Any] | None = None, model: str = "policy") -> None:
    """``loongsage validate``: the environment named in ``agent_args`` loads (a ``ValueError``
    naming it otherwise); without ``env`` the rows' environment is used, checked by the source."""
    if env is not None:
        check_env(env, env_args or {})
    elif env_args:
        raise ValueError("env_args without env: name the verifiers environment they configure")
