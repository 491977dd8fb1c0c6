"""Code repair end to end with a scripted agent: the reward grades exactly what the agent did.

A real program (tests/data/scripted_repair_agent.py, the OpenAI SDK against the real router in
front of a real embedded engine) is run by the ``command`` agent inside the trajectory's ``local``
sandbox (as the sandbox's user, reaching only its endpoint), prepared from a shipped task's row
(its repository tarball). It issues ``bash`` and ``edit`` tool calls by script. Then the host's
reward path (``score_trajectory_async`` with ``swe_tests``) runs the task's tests in that same
sandbox before it is destroyed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sysconfig
from pathlib import Path

import pytest

from loongsage_core.agentflow import run_agent_trajectory
from loongsage_core.config import DataConfig, JobConfig
from loongsage_core.controller.rewards import SourceRewards, score_trajectory_async
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import BuildContext, ComponentRef, Trajectory, TrajectoryStatus

REPO = Path(__file__).resolve().parents[2]
SWE = REPO / "configs" / "recipes" / "swe"
AGENT = REPO / "tests" / "data" / "scripted_repair_agent.py"
ROWS = {json.loads(line)["instance_id"]: json.loads(line) for line in (SWE / "tasks.jsonl").read_text().splitlines()}
PAGER = ROWS["loongsage-mini__pager-1"]
# an edit that breaks page_count, whose test (PASS_TO_PASS) passed before
BREAK = ["--break-file", "pager/core.py", "--break-old", "(total + per_page - 1) // per_page",
         "--break-new", "total // per_page"]


@pytest.fixture(scope="module")
def host():
    return PluginHost.create(["agents", "rewards"])


def repair(host, router, provider, mode: str, extra: list[str] = (), tid: str = "swe-1") -> tuple[Trajectory, list]:
    """One trajectory of the scripted agent in ``mode``; also the sandbox directories seen meanwhile."""
    source = DataConfig(name="swe", reward=["swe_tests"], sandbox="local")
    rewards = SourceRewards.bind(JobConfig(data=[source]), source, "data[0]", host)
    seen: list[str] = []

    async def score(traj: Trajectory, sandbox) -> None:
        seen.append(sandbox.workdir)
        assert os.path.isdir(sandbox.workdir)  # scored while the sandbox still exists
        await score_trajectory_async(traj, rewards, sandbox)

    meta = {k: v for k, v in PAGER.items() if k != "problem_statement"}
    traj = Trajectory(id=tid, prompt_id="p0", group_id="g0", prompt=PAGER["problem_statement"], metadata=meta)
    # the program runs in the sandbox as its user: an interpreter and packages (openai) it can read
    args = {"command": [provider.python, str(AGENT), "--mode", mode, *extra], "timeout_s": 120,
            "env": {"PYTHONPATH": sysconfig.get_paths()["purelib"]}}
    agent = host.bind(ComponentRef("agent", "command", args), BuildContext(components=host))
    traj = asyncio.run(run_agent_trajectory(router, agent, provider, trajectory=traj,
                                            sampling={"max_new_tokens": 4, "seed": 1}, timeout_s=180, score=score,
                                            max_context_length=1024))
    return traj, seen


@pytest.fixture
def setup(slow_fixture, host, engine_url, router_factory):
    provider = host.bind(ComponentRef("sandbox", "local", {"base_dir": str(SWE), "default_timeout_s": 60}),
                         BuildContext(components=host))
    yield host, router_factory([engine_url]), provider
    asyncio.run(provider.close())


def tool_calls(traj: Trajectory) -> list[str]:
    return [c["function"]["name"] for m in traj.messages for c in (m.get("tool_calls") or [])]


def test_the_correct_patch_scores_1(setup):
    host, router, provider = setup
    traj, seen = repair(host, router, provider, "fix")
    assert traj.status == TrajectoryStatus.COMPLETED, traj.error
    assert traj.reward.score == 1.0, traj.reward.reason
    why = traj.metadata["swe_tests"]
    assert why["resolved"] is True and set(why["outcomes"].values()) == {"passed"}
    # the router recorded the conversation with the tool calls the program made, in order
    assert tool_calls(traj) == ["bash", "edit", "bash"]
    assert traj.metadata["agentflow"]["turns"] == 4 and traj.segments
    assert traj.response_text.startswith("Done (3 tool calls)")
    assert len(seen) == 1 and not os.path.exists(seen[0])  # destroyed after the reward


def test_no_change_scores_0(setup):
    host, router, provider = setup
    traj, _ = repair(host, router, provider, "none", tid="swe-2")
    assert traj.status == TrajectoryStatus.COMPLETED, traj.error
    assert traj.reward.score == 0.0
    why = traj.metadata["swe_tests"]
    assert why["failed"] == PAGER["FAIL_TO_PASS"] and why["resolved"] is False
    assert all(why["outcomes"][t] == "passed" for t in PAGER["PASS_TO_PASS"])
    assert tool_calls(traj) == ["bash"]


def test_the_reward_sees_exactly_the_agents_edits(setup):
    """The fix plus a second edit that breaks a passing test: the regression test now passes, the
    broken one fails, and the score is 0 for that reason alone."""
    host, router, provider = setup
    traj, _ = repair(host, router, provider, "fix_break", BREAK, tid="swe-3")
    assert traj.status == TrajectoryStatus.COMPLETED, traj.error
    assert traj.reward.score == 0.0
    why = traj.metadata["swe_tests"]
    assert why["failed"] == ["tests.test_core.TestBasics.test_page_count"]
    assert why["outcomes"][PAGER["FAIL_TO_PASS"][0]] == "passed"
    assert why["outcomes"]["tests.test_core.TestBasics.test_bad_page"] == "passed"
    assert tool_calls(traj) == ["bash", "edit", "edit"]
    assert traj.reward.details["swe_tests/f2p_passed"] == 1.0 and traj.reward.details["swe_tests/p2p_passed"] == 0.5
