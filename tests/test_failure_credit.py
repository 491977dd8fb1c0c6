"""Failure-aware credit assignment: a failed trajectory carries whose fault it was; the policy's
own failures are trained on with reward 0, infrastructure failures are left out of their group's
statistics and of the loss (or count with reward 0 under ``infra_failures = "zero_reward"``), and
a group left with fewer than two samples is not trained."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch
from loongsage_plugin_rl.advantages import grpo

from loongsage_core.controller.batching import build_batch
from loongsage_hookspecs import (
    AdvantageInputs,
    FailureClass,
    Reward,
    Segment,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
)

FATES = {0: ["ok", "infra", "agent", "ok"], 1: ["ok", "infra", "infra", "infra"]}
"""What happens to sample j of group g at every step: half of the trajectories crash in the agent."""

MODULE = f'''
from loongsage_hookspecs import AgentFailure, AgentSpec, RewardSpec, hookimpl
from loongsage_plugin_agents.single_turn import SingleTurnAgent

FATES = {FATES!r}


class CrashingAgent:
    """One real turn through the router, then what FATES says: return, or crash (the
    infrastructure: a sandbox that died), or fail by the policy's doing (AgentFailure)."""

    def __init__(self):
        self.turn = SingleTurnAgent()

    async def run(self, ctx):
        result = await self.turn.run(ctx)
        _, group, sample = ctx.trajectory_id.split("-")
        fate = FATES[int(group)][int(sample)]
        if fate == "infra":
            raise RuntimeError("the sandbox crashed (on purpose)")
        if fate == "agent":
            raise AgentFailure("the tool call could not be parsed (on purpose)")
        return result


def spread(traj):
    """A score that differs within every group: the answer's length plus a quarter per sample index."""
    return traj.response_length + 0.25 * int(traj.id.rsplit("-", 1)[1])


@hookimpl
def loongsage_agents():
    yield AgentSpec(name="crashing", factory=lambda ctx: CrashingAgent())


@hookimpl
def loongsage_rewards():
    yield RewardSpec(name="spread", fn=spread)
'''


def expected_grpo(scores: list[float]) -> list[float]:
    """The plugin's GRPO advantages of one group holding exactly ``scores``."""
    n = len(scores)
    out = grpo(AdvantageInputs(rewards=torch.tensor(scores), response_mask=torch.ones(n, 1),
                               group_index=torch.zeros(n, dtype=torch.long)))
    return out.advantages[:, 0].tolist()


def run_records(tiny_job, tmp_path: Path, *overrides: str) -> tuple[list[dict], dict[str, float]]:
    (tmp_path / "crashing.py").write_text(MODULE)
    out = tmp_path / "run"
    history = tiny_job.run(tmp_path, out, 'plugins.modules=["crashing.py"]', "data.0.agent=crashing",
                           "data.0.reward=spread", "train.total_steps=1", "run.checkpoint_every=0", *overrides)
    with gzip.open(out / "rollouts" / "step_000000.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f], history[0]


def advantage_of(record: dict) -> float | None:
    """The advantage the trainer gave the trajectory (on its first trained token), or None."""
    for seg in record["segments"]:
        if seg["row"] is not None:
            return next(a for a, m in zip(seg["advantages"], seg["loss_mask"]) if m)
    return None


def by_slot(records: list[dict]) -> dict[tuple[int, int], dict]:
    return {tuple(int(x) for x in r["id"].split("-")[1:]): r for r in records}


def test_infra_failures_are_left_out_of_the_group_and_agent_failures_count_with_reward_0(
        ray_cluster, tiny_job, tmp_path):
    records, metrics = run_records(tiny_job, tmp_path)
    slots = by_slot(records)
    assert metrics["rollout/infra_failed_ratio"] == 0.5 and metrics["rollout/failed_ratio"] == 0.625
    for (g, j), r in slots.items():
        fate = FATES[g][j]
        assert r["failure"] == (None if fate == "ok" else fate), r
        assert r["status"] == ("ok" if fate == "ok" else "failed") or r["status"] == "truncated"
    # group 0: the crashed sample is not trained; the others' advantages are those of the group
    # without it, the policy's own failure counting as a score of 0
    survivors = [j for j in range(4) if FATES[0][j] != "infra"]
    scores = [slots[(0, j)]["reward"]["score"] if FATES[0][j] == "ok" else 0.0 for j in survivors]
    assert slots[(0, 2)]["reward"] is None and not slots[(0, 1)]["trained"]
    got = [advantage_of(slots[(0, j)]) for j in survivors]
    assert got == pytest.approx(expected_grpo(scores), abs=1e-5), (got, scores)
    assert any(abs(a) > 1e-3 for a in got)  # the scores differ: a real signal, not zeros
    # group 1 kept a single sample: nothing of it is trained
    assert not any(slots[(1, j)]["trained"] for j in range(4))
    assert metrics["rollout/num_rows"] == 3.0 and math.isfinite(metrics["train/loss"])


def test_zero_reward_mode_trains_infra_failures_with_reward_0(ray_cluster, tiny_job, tmp_path):
    records, metrics = run_records(tiny_job, tmp_path, 'algorithm.infra_failures=zero_reward')
    slots = by_slot(records)
    assert metrics["rollout/num_rows"] == 8.0
    for g in (0, 1):
        scores = [slots[(g, j)]["reward"]["score"] if FATES[g][j] == "ok" else 0.0 for j in range(4)]
        got = [advantage_of(slots[(g, j)]) for j in range(4)]
        assert got == pytest.approx(expected_grpo(scores), abs=1e-5), (g, got, scores)


def trajectory(tid: str, status: TrajectoryStatus, failure: FailureClass | None = None, score: float = 1.0
               ) -> Trajectory:
    seg = Segment()
    seg.append([1, 2], generated=False)
    seg.append([3], generated=True, logprobs=[-0.5], weight_version=0)
    t = Trajectory(id=tid, prompt_id="p", group_id=tid[0], segments=[seg], status=status, failure=failure,
                   reward=Reward(score=score) if status == TrajectoryStatus.COMPLETED else None)
    return t


def test_build_batch_credit_rule():
    ok, failed, aborted = TrajectoryStatus.COMPLETED, TrajectoryStatus.FAILED, TrajectoryStatus.ABORTED
    a = TrajectoryGroup(group_id="a", prompt_id="p", trajectories=[
        trajectory("a0", ok), trajectory("a1", failed, FailureClass.INFRA),
        trajectory("a2", failed, FailureClass.AGENT), trajectory("a3", failed), trajectory("a4", aborted)])
    b = TrajectoryGroup(group_id="b", prompt_id="q", trajectories=[
        trajectory("b0", ok, score=0.5), trajectory("b1", failed, FailureClass.INFRA)])
    excluded = build_batch([a, b], min_group_samples=2)
    assert excluded.meta["trajectory_id"] == ["a0", "a2"]  # unknown failures count as infrastructure
    assert excluded["sample_index"].tolist() == [0, 1] and excluded["rewards"].tolist() == [1.0, 0.0]
    assert build_batch([a, b]).meta["trajectory_id"] == ["a0", "a2", "b0"]  # no minimum group size
    zero = build_batch([a, b], infra_failures="zero_reward", min_group_samples=2)
    assert zero.meta["trajectory_id"] == ["a0", "a1", "a2", "a3", "b0", "b1"]
    assert zero["sample_index"].tolist() == list(range(6)) and zero["group_index"].tolist() == [0, 0, 0, 0, 1, 1]


def test_a_step_of_nothing_but_failures_is_a_bad_step_even_when_some_were_trained():
    from loongsage_core.controller.health import diagnose

    failed = TrajectoryStatus.FAILED
    group = TrajectoryGroup(group_id="a", prompt_id="p", trajectories=[
        trajectory("a0", failed, FailureClass.AGENT), trajectory("a1", failed, FailureClass.AGENT)])
    for t in group.trajectories:
        t.error = "AgentFailure: the tool call could not be parsed"
    trained = {"rollout/num_rows": 2.0, "train/loss": 0.1, "train/grad_norm": 0.5, "train/num_mini_batches": 1.0}
    assert diagnose(trained, [group]) == ("every trajectory failed: 2 of 2 trajectories failed, 2 with: "
                                          "AgentFailure: the tool call could not be parsed")
    group.trajectories.append(trajectory("a2", TrajectoryStatus.COMPLETED))
    assert diagnose(trained, [group]) is None
