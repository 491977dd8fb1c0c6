"""Rollout metrics computed by the controller (the train-inference gap and the advantage
statistics are the step algorithm's: :mod:`loongsage_core.algorithms.step`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from loongsage_hookspecs import FailureClass, Trajectory, TrajectoryGroup, TrajectoryStatus


def rollout_metrics(groups: Sequence[TrajectoryGroup], correct_threshold: float = 1.0) -> dict[str, float]:
    """``rollout/*`` over every sampled trajectory, plus ``rollout_per_source/<name>/*``."""
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        return {"rollout/num_trajectories": 0.0}
    scored = [t for t in trajs if t.status == TrajectoryStatus.COMPLETED]
    scores = [t.score for t in scored] or [0.0]
    lengths = [t.response_length for t in trajs]
    out = {
        "rollout/num_trajectories": float(len(trajs)),
        "rollout/reward_mean": sum(scores) / len(scores),
        "rollout/reward_max": max(scores),
        "rollout/reward_min": min(scores),
        "rollout/response_length_mean": sum(lengths) / len(lengths),
        "rollout/response_length_max": float(max(lengths)),
        "rollout/truncated_ratio": sum(t.finish_reason == "length" for t in trajs) / len(trajs),
        "rollout/failed_ratio": sum(t.status == TrajectoryStatus.FAILED for t in trajs) / len(trajs),
        # failed by the infrastructure (sandbox, agent CLI, engine, reward), not by the policy
        "rollout/infra_failed_ratio": sum(t.status == TrajectoryStatus.FAILED and t.failure != FailureClass.AGENT
                                          for t in trajs) / len(trajs),
        "rollout/aborted_ratio": sum(t.status == TrajectoryStatus.ABORTED for t in trajs) / len(trajs),
    }
    cache = [t.metadata["prefix_cache"] for t in trajs if isinstance(t.metadata.get("prefix_cache"), dict)]
    prompt_tokens = sum(int(c.get("prompt_tokens", 0)) for c in cache)
    if prompt_tokens:  # share of prompt tokens the engines' prefix caches served (SGLang's cached_tokens)
        out["rollout/prefix_cache_hit_ratio"] = sum(int(c.get("cached_tokens", 0)) for c in cache) / prompt_tokens
    out.update(speculation_metrics(trajs))
    out.update(agent_metrics(trajs))
    groups_scores = [g.scores for g in groups if g.trajectories]
    out["rollout/all_correct_ratio"] = sum(all(s >= correct_threshold for s in gs) for gs in groups_scores) / max(
        1, len(groups_scores))
    out["rollout/all_wrong_ratio"] = sum(all(s < correct_threshold for s in gs) for gs in groups_scores) / max(
        1, len(groups_scores))
    per_source: dict[str, list[float]] = defaultdict(list)
    per_source_len: dict[str, list[int]] = defaultdict(list)
    details: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for t in scored:
        per_source[t.source].append(t.score)
        per_source_len[t.source].append(t.response_length)
        if t.reward is not None:
            for k, v in t.reward.details.items():
                details[t.source][k].append(v)
    for name, vals in per_source.items():
        out[f"rollout_per_source/{name}/reward_mean"] = sum(vals) / len(vals)
        out[f"rollout_per_source/{name}/count"] = float(len(vals))
        out[f"rollout_per_source/{name}/response_length_mean"] = sum(per_source_len[name]) / len(per_source_len[name])
        for k, vs in details[name].items():
            out[f"rollout_per_source/{name}/reward/{k}"] = sum(vs) / len(vs)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def agent_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Metrics of the trajectories that ran through the router (agents), none when there are none:
    sandbox create/teardown seconds, tool calls and model turns per trajectory, the share that
    failed in the agent (crash, timeout, setup) rather than in a reward."""
    agentic = [t for t in trajs if isinstance(t.metadata.get("agentflow"), dict)]
    if not agentic:
        return {}
    out = {
        "rollout/turns_mean": _mean([float(t.metadata["agentflow"].get("turns", 0)) for t in agentic]),
        "rollout/tool_calls_mean": _mean([float((t.metadata["agentflow"].get("agent") or {}).get("tool_calls", 0))
                                          for t in agentic]),
        "rollout/agent_failed_ratio": sum(t.metadata.get("failed_in") == "agent" for t in agentic) / len(agentic),
    }
    boxes = [t.metadata["sandbox"] for t in agentic if isinstance(t.metadata.get("sandbox"), dict)]
    for key in ("sandbox_create_s", "sandbox_teardown_s"):
        values = [float(b[key]) for b in boxes if key in b]
        if values:
            out[f"rollout/{key}"] = _mean(values)
    return out


def speculation_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Speculative decoding over the trajectories whose engine reported it (none without any):
    ``rollout/spec_acceptance_rate`` (accepted / drafted tokens, when any were drafted) and
    ``rollout/spec_tokens_per_forward`` (tokens emitted per decode forward; 1.0 is plain decoding)."""
    counts = [t.metadata["speculative"] for t in trajs if isinstance(t.metadata.get("speculative"), dict)]
    if not counts:
        return {}
    total = {key: sum(int(c.get(key, 0)) for c in counts)
             for key in ("verify_forwards", "draft_tokens", "accepted_tokens", "emitted_tokens")}
    out = {"rollout/spec_tokens_per_forward": total["emitted_tokens"] / max(1, total["verify_forwards"])}
    if total["draft_tokens"]:  # an engine that reports its verify forwards only (SGLang) gives no rate
        out["rollout/spec_acceptance_rate"] = total["accepted_tokens"] / total["draft_tokens"]
    return out
