"""A played verifiers episode as what the agent returns, and as the ``verifiers`` reward.

verifiers scores inside the episode: after a seat's run the task's ``@vf.reward`` functions
(weighted) and ``@vf.metric`` functions record into the trace (``trace.rewards``,
``trace.metrics``; ``trace.reward`` is the weighted sum), the harness's metrics too, and then
``Env.finalize(task, episode)`` judges the episode's traces together (comparing sibling attempts,
judging a conversation across seats) and records more. :func:`episode_outcome` keeps all of it,
as plain JSON, in the agent's ``metadata["verifiers"]``; :func:`verifiers_reward` turns it into
LoongSage's :class:`~loongsage_hookspecs.Reward`.

Several trainable traces in one episode (an environment whose ``run`` plays the policy more than
once) are one trajectory here: the score is their mean, each function's value the mean over the
traces that recorded it, and the conversation the last trace's.
"""

from __future__ import annotations

from typing import Any, Mapping

from loongsage_hookspecs import AgentResult, Reward

from .envs import ROW_KEY


def _wire(messages: Any) -> list[dict[str, Any]]:
    from verifiers.v1.dialects.chat import message_to_wire

    return [message_to_wire(m) for m in messages]


def _mean_by_name(values: list[Mapping[str, float | None]]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for record in values:
        for name, value in record.items():
            if value is not None:
                sums.setdefault(name, []).append(float(value))
    return {name: sum(v) / len(v) for name, v in sums.items()}


def _error_text(error: Any) -> str:
    return f"{error.type}: {error.message}" if error is not None else "unknown error"


def episode_outcome(episode: Any, endpoint: str) -> AgentResult:
    """What the agent returns for a played ``episode`` (see the module doc); raises for an episode
    that failed (an error in the env's hooks, a harness that crashed, a model call refused) or that
    would train on a non-trainable seat's turns (one sampling ``endpoint``)."""
    for trace in episode.traces:
        client = trace.agent.config.client
        if not trace.agent.trainable and client is not None and getattr(client, "base_url", None) == endpoint:
            raise ValueError(f"seat {trace.agent.name!r} is not trainable but samples the policy: its turns would "
                             "be trained on; give it a model of its own (env_args.<seat>.client and model)")
    trainable = [t for t in episode.traces if t.agent.trainable]
    if not episode.ok or not trainable:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        reason = _error_text(errors[-1]) if errors else "no trainable seat ran"
        raise RuntimeError(f"verifiers episode of task {episode.task.data.idx} failed: {reason}")
    last = trainable[-1]
    rewards = _mean_by_name([{k: (None if r is None else r.score) for k, r in t.rewards.items()} for t in trainable])
    weights = {k: r.weight for t in trainable for k, r in t.rewards.items() if r is not None}
    outcome = {
        "env": episode.env.id,
        "reward": sum(t.reward for t in trainable) / len(trainable),
        "rewards": rewards,
        "weights": weights,
        "metrics": _mean_by_name([t.metrics for t in trainable]),
        "stop": last.stop_condition,
        "turns": sum(t.num_turns for t in trainable),
        "traces": len(episode.traces),
        "trainable_traces": len(trainable),
        "timing": {stage: sum(getattr(t.timing, stage).duration for t in trainable)
                   for stage in ("setup", "agent", "scoring")},
    }
    return AgentResult(response_text=last.last_reply, messages=_wire(last.messages), metadata={ROW_KEY: outcome})


def verifiers_reward(trajectory: Any) -> Reward:
    """The environment's score of the trajectory's episode, each reward and metric function's
    value as a detail (logged as ``rollout_per_source/<source>/reward/<name>``)."""
    agent = trajectory.metadata.get("agentflow", {}).get("agent", {})
    outcome = agent.get(ROW_KEY) if isinstance(agent, Mapping) else None
    if not isinstance(outcome, Mapping):
        raise ValueError(f"trajectory {trajectory.id}: the 'verifiers' reward reads the score the environment "
                         "gave the episode; use it with agent = 'verifiers'")
    details = {str(k): float(v) for k, v in outcome["rewards"].items()}
    for name, value in outcome["metrics"].items():
        details[name if name not in details else f"metric_{name}"] = float(value)
    parts = [f"{k}={v:g}" + (f" (x{outcome['weights'][k]:g})" if outcome["weights"].get(k, 1.0) != 1.0 else "")
             for k, v in outcome["rewards"].items()]
    reason = f"{outcome['env']}: " + (", ".join(parts) or "no reward functions") + f"; stop: {outcome['stop']}"
    return Reward(score=float(outcome["reward"]), details=details, reason=reason)
