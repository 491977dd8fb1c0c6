"""Held-out evaluation of a run's policy: :class:`Evaluator` (the job's ``[eval]`` table).

An evaluation generates answers to every prompt of the ``[[eval.data]]`` sources through the run's
rollout (the same agents, AgentFlow router, engines and rewards as training, with the weights the
engines serve), scores them, and reports per source::

    eval/<source>/reward_mean        mean reward of every answer
    eval/<source>/pass@k             unbiased pass@k for k = 1, 2, 4, ... up to [eval] samples
    eval/<source>/turns_mean         model turns per answer (1 for a single-turn agent)
    eval/<source>/tool_calls_mean    tool calls per answer
    eval/<source>/failed_ratio       answers whose agent or reward failed (they score 0)
    eval/<source>/reward/<name>      mean of each reward component
    eval/<source>/response_length_mean

It never trains and never draws from the training data: the loops log its metrics with the step
they precede (and, after the last step, as step ``train.total_steps``), the rollout records keep
its trajectories marked ``"eval": true``, and nothing of it enters a checkpoint, so a resumed run
continues exactly. Sampling seeds depend on the run's seed, the step and the prompt, so
``loongsage eval`` on a checkpoint samples what the run's own evaluation at that step sampled.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Sequence

import attrs

from loongsage_hookspecs import TrajectoryGroup, TrajectoryStatus

from ..config import EvalConfig, JobConfig
from ..data_sources import load_rows
from .data import Prompt

if TYPE_CHECKING:  # pragma: no cover
    from .rollout import RolloutManager

EVAL_PREFIX = "eval:"
"""Eval sources are generated under ``eval:<name>`` (their metrics are ``eval/<name>/...``)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate that at least one of ``k`` answers drawn from ``n`` (``c`` correct)
    is correct: ``1 - C(n - c, k) / C(n, k)``."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_up_to(samples: int) -> list[int]:
    """1, 2, 4, ... up to ``samples`` (and ``samples`` itself)."""
    ks, k = [], 1
    while k <= samples:
        ks.append(k)
        k *= 2
    return ks if ks[-1] == samples else [*ks, samples]


def eval_job(job: JobConfig) -> JobConfig:
    """The job with its ``[[eval.data]]`` sources in place of ``[[data]]`` (what the data loaders
    read), each renamed ``eval:<name>`` and, with ``[eval] greedy``, sampled at temperature 0."""
    cfg = job.eval
    sources = [attrs.evolve(src, name=EVAL_PREFIX + src.name,
                            sampling={**src.sampling, "temperature": 0.0} if cfg.greedy else dict(src.sampling))
               for src in cfg.data]
    return attrs.evolve(job, data=sources)


def source_metrics(name: str, groups: Sequence[TrajectoryGroup], cfg: EvalConfig) -> dict[str, float]:
    """The ``eval/<name>/*`` metrics of one source's evaluated groups."""
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        return {}
    key = f"eval/{name}"
    scores = [t.score if t.status == TrajectoryStatus.COMPLETED else 0.0 for t in trajs]
    out = {f"{key}/reward_mean": sum(scores) / len(scores),
           f"{key}/failed_ratio": sum(t.status == TrajectoryStatus.FAILED for t in trajs) / len(trajs),
           f"{key}/response_length_mean": sum(t.response_length for t in trajs) / len(trajs),
           f"{key}/turns_mean": sum(_turns(t) for t in trajs) / len(trajs),
           f"{key}/tool_calls_mean": sum(_tool_calls(t) for t in trajs) / len(trajs),
           f"{key}/prompts": float(len(groups))}
    for k in ks_up_to(cfg.samples):
        per_prompt = []
        for g in groups:
            ok = [t.status == TrajectoryStatus.COMPLETED and t.score >= cfg.success_threshold for t in g.trajectories]
            if len(ok) >= k:
                per_prompt.append(pass_at_k(len(ok), sum(ok), k))
        if per_prompt:
            out[f"{key}/pass@{k}"] = sum(per_prompt) / len(per_prompt)
    parts: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        for part, reward in (getattr(t.reward, "components", None) or {}).items():
            parts[part].append(float(reward.score))
    for part, values in parts.items():
        out[f"{key}/reward/{part}"] = sum(values) / len(values)
    return out


def _turns(traj: Any) -> int:
    return sum(len(seg.turns) for seg in traj.segments) or (1 if traj.response_length else 0)


def _tool_calls(traj: Any) -> int:
    return sum(len(m.get("tool_calls") or []) for m in traj.messages if m.get("role") == "assistant")


class Evaluator:
    """The job's ``[eval]``: its prompts (read once), when it is due, and one evaluation."""

    def __init__(self, job: JobConfig, components: Any) -> None:
        self.cfg = job.eval
        self.job = eval_job(job)
        self.prompts: list[Prompt] = []
        for i, src in enumerate(self.job.data):
            rows = load_rows(self.job, i, components)
            if self.cfg.max_prompts:
                rows = rows[:self.cfg.max_prompts]
            name = src.name.removeprefix(EVAL_PREFIX)
            self.prompts += [Prompt(prompt_id=f"{name}/{j}", source=src.name, prompt=r["prompt"], label=r["label"],
                                    metadata=r["metadata"]) for j, r in enumerate(rows)]

    def due(self, step: int, total_steps: int) -> bool:
        return self.cfg.due(step, total_steps)

    def register(self, rollout: "RolloutManager") -> None:
        """Make the eval sources generatable by ``rollout`` (their agents, sandboxes and rewards
        bound as the job names them, under ``eval.data[i]``)."""
        for i, src in enumerate(self.job.data):
            rollout.add_source(src, f"eval.data[{i}]", job=self.job)

    async def evaluate(self, rollout: "RolloutManager", step: int) -> tuple[dict[str, float], list[TrajectoryGroup]]:
        """Evaluate the policy the engines serve now, before step ``step``: the ``eval/*`` metrics
        and the evaluated groups (for the rollout records)."""
        groups = list(await asyncio.gather(*(
            rollout.group(p, i, f"eval{step}", samples=self.cfg.samples, via_router=None)
            for i, p in enumerate(self.prompts))))
        metrics: dict[str, float] = {}
        for src in self.job.data:
            name = src.name.removeprefix(EVAL_PREFIX)
            metrics.update(source_metrics(name, [g for g in groups if g.source == src.name], self.cfg))
        return metrics, groups
