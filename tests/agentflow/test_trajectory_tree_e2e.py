"""Trajectory trees end to end: the scripted harness of tree_harness.py (three turns, a compaction,
a two-turn sub-agent, a last turn) through the real router and a real embedded engine; then its
trajectories as training rows and GRPO advantages."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from loongsage_core.agentflow import run_agent_trajectory
from loongsage_core.algorithms import StepAlgorithm
from loongsage_core.config import structure_job
from loongsage_core.controller.batching import build_batch
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import Reward, Trajectory, TrajectoryGroup, TrajectoryStatus

HARNESS = Path(__file__).with_name("tree_harness.py")
PROMPT = "Fix the failing test."


@pytest.fixture(scope="module")
def harness(slow_fixture):
    """tree_harness.py, loaded by path (test helpers are not importable under importlib mode)."""
    spec = importlib.util.spec_from_file_location("tree_harness", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_harness(router, harness, tid: str, seed: int):
    agent = harness.CompactingHarness(max_tokens=8)
    traj = Trajectory(id=tid, prompt_id="p0", group_id="g0", prompt=PROMPT)
    asyncio.run(run_agent_trajectory(router, agent, None, trajectory=traj, sampling={"seed": seed}, timeout_s=240))
    assert traj.status == TrajectoryStatus.COMPLETED, traj.error
    return traj, agent.calls


def closing(renderer, last_generated: int) -> str:
    """What the template writes after a model turn before the next message: the turn-end token
    unless the model wrote one (its turn was cut at the token limit), then the line break."""
    return "\n" if last_generated in renderer.turn_end_ids else "<|im_end|>\n"


def test_compaction_and_a_sub_agent_are_recorded_as_a_tree(engine_url, router_factory, renderer, harness):
    router = router_factory([engine_url])
    traj, calls = run_harness(router, harness, "tree-1", seed=5)
    segs = traj.segments
    tree = traj.metadata["agentflow"]["tree"]
    task = renderer.encode(renderer.render([{"role": "system", "content": harness.MAIN_SYSTEM},
                                            {"role": "user", "content": PROMPT}], add_generation_prompt=False))
    you_are = renderer.encode("<|im_start|>system\nYou are")  # where the two system prompts part
    assert [(s.parent, s.fork_at) for s in segs] == [(None, None), (0, len(task) + 1), (0, len(you_are))]
    assert [(t["segment"], t["parent"], t["fork_at"], t["turns"]) for t in tree] == [
        (0, None, None, [0, 1, 2]), (1, 0, len(task) + 1, [3, 6]), (2, 0, len(you_are), [4, 5])]
    assert [t["reason"] for t in tree] == ["first request"] + ["request does not repeat the recorded conversation"] * 2
    assert traj.metadata["agentflow"]["turns"] == len(calls) == 7
    for seg in segs[1:]:
        assert seg.tokens[:seg.fork_at] == segs[seg.parent].tokens[:seg.fork_at]
        assert seg.tokens[seg.fork_at] != segs[seg.parent].tokens[seg.fork_at]

    # every turn, in the order the harness made them: mask 1 on exactly what the engine generated
    # (the tokens whose log-probs and text the agent got back), mask 0 on the template's rendering
    where = {k: (t["segment"], i) for t in tree for i, k in enumerate(t["turns"])}
    for k, (name, request, answer) in enumerate(calls):
        s, i = where[k]
        seg = segs[s]
        start, end = seg.turns[i]
        ids = seg.tokens[start:end]
        assert seg.loss_mask[start:end] == [1] * len(ids) and answer.usage.completion_tokens == len(ids)
        assert answer.usage.prompt_tokens == start  # the engine's context was the segment up to the turn
        assert answer.choices[0].message.content == renderer.content_of(ids)
        sent = [c.logprob for c in answer.choices[0].logprobs.content]
        assert sent == pytest.approx(seg.logprobs[start:start + len(sent)], abs=1e-6)
        assert all(v >= 0 for v in seg.weight_versions[start:end])
        prompt_start = seg.turns[i - 1][1] if i else 0
        prompt = seg.tokens[prompt_start:start]
        assert not any(seg.loss_mask[prompt_start:start])
        if i == 0:  # the segment's first turn: the template's rendering of the whole request
            assert prompt == renderer.prompt_tokens(request)
        else:  # a later one: only the new message; the earlier turns' generated tokens stay as they were
            prev = seg.tokens[prompt_start - 1]
            new = request[-1]
            assert renderer.decode(prompt) == (closing(renderer, prev) + f"<|im_start|>user\n{new['content']}"
                                               "<|im_end|>\n<|im_start|>assistant\n")
        assert (name == "sub") == (s == 2)
    assert sum(sum(s.loss_mask) for s in segs) == sum(a.usage.completion_tokens for _, _, a in calls)


def test_tree_trajectories_are_one_sample_each_in_grpo(engine_url, router_factory, harness):
    router = router_factory([engine_url])
    trajs = [run_harness(router, harness, f"grpo-{i}", seed=11 + i)[0] for i in range(2)]
    for traj, score in zip(trajs, (1.0, 0.0)):
        traj.reward = Reward(score=score)
    batch = build_batch([TrajectoryGroup("g0", "p0", trajectories=trajs)])
    # one row per segment, the rows of one trajectory sharing a sample index
    assert len(batch) == 6 and batch.meta["segment"] == [0, 1, 2] * 2
    assert batch["sample_index"].tolist() == [0, 0, 0, 1, 1, 1]
    # every generated token is trained once: the shared prefixes are not in any loss mask twice
    assert batch["loss_mask"].sum().item() == sum(t.response_length for t in trajs)

    job = structure_job({"plugins": {"enable": ["rl"]}, "algorithm": {"advantage": "grpo"},
                         "data": [{"name": "a", "path": "x.jsonl"}]}, source="job.toml")
    algo = StepAlgorithm.from_job(job, PluginHost.from_job(job))
    batch.tensors["old_logprobs"] = batch["rollout_logprobs"].clone()
    algo.prepare(batch)
    # the same two trajectories with their last segment only: the group statistics are the same,
    # so the tree's three segments counted once
    whole = [Trajectory(id=t.id, prompt_id="p0", group_id="g0", segments=[t.segments[1]], reward=t.reward,
                        status=TrajectoryStatus.COMPLETED) for t in trajs]
    single = build_batch([TrajectoryGroup("g0", "p0", trajectories=whole)])
    single.tensors["old_logprobs"] = single["rollout_logprobs"].clone()
    algo.prepare(single)
    per_row = [set(row[mask > 0].tolist()) for row, mask in zip(batch["advantages"], batch["loss_mask"])]
    expected = [set(row[mask > 0].tolist()) for row, mask in zip(single["advantages"], single["loss_mask"])]
    assert per_row == [expected[0]] * 3 + [expected[1]] * 3
    assert next(iter(expected[0])) > 0 > next(iter(expected[1]))
