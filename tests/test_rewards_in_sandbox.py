"""Rewards run off the event loop under a time limit, and a reward that needs the sandbox gets it
before teardown (the host's scoring with a user reward module and the real ``local`` sandbox)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from loongsage_core.config import DataConfig, JobConfig
from loongsage_core.controller.rewards import SourceRewards, score_trajectory_async
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import Trajectory, TrajectoryStatus

MODULE = '''
import time
from loongsage_hookspecs import Reward, RewardSpec, hookimpl


def hang(traj):
    time.sleep(30)
    return 1.0


def in_sandbox(traj, sandbox, command="cat answer.txt"):
    res = sandbox.run(command, timeout_s=20)
    return Reward(score=float(res.stdout.strip() == "42"), reason=f"exit {res.exit_code}: {res.stdout.strip()}")


@hookimpl
def loongsage_rewards():
    yield RewardSpec(name="hang", fn=hang)
    yield RewardSpec(name="in_sandbox", fn=in_sandbox, needs_sandbox=True)
'''


def host(tmp_path: Path) -> PluginHost:
    module = tmp_path / "user_rewards.py"
    module.write_text(MODULE)
    return PluginHost.create(modules=[str(module)], entry_points=False)


def rewards(components: PluginHost, source: DataConfig) -> SourceRewards:
    """The source's rewards bound as a run binds them."""
    return SourceRewards.bind(JobConfig(data=[source]), source, "data[0]", components)


def traj(tid: str) -> Trajectory:
    t = Trajectory(id=tid, prompt_id="p", group_id="g", prompt="x")
    t.status = TrajectoryStatus.COMPLETED
    return t


def test_a_hanging_reward_fails_its_trajectory_and_leaves_the_loop_free(tmp_path):
    scoring = rewards(host(tmp_path), DataConfig(name="s", reward=["hang"], reward_timeout_s=0.5))

    async def scenario():
        ticks = 0

        async def ticker():  # the event loop keeps running while the reward hangs
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        task = asyncio.create_task(ticker())
        t0 = time.monotonic()
        t = traj("h")
        await score_trajectory_async(t, scoring)
        task.cancel()
        return t, time.monotonic() - t0, ticks

    t, seconds, ticks = asyncio.run(scenario())
    assert seconds < 5 and ticks >= 5
    assert t.status == TrajectoryStatus.FAILED and "did not finish within 0.5s" in t.error
    assert t.metadata["failed_in"] == "reward" and t.reward.score == 0.0


def test_a_sandbox_reward_runs_in_the_trajectory_sandbox(tmp_path):
    from loongsage_plugin_agents.local_sandbox import LocalSandboxProvider

    scoring = rewards(host(tmp_path), DataConfig(name="s", reward=["in_sandbox"]))
    provider = LocalSandboxProvider(default_timeout_s=30)

    async def scenario():
        box = await provider.create("r")
        await box.exec("echo 42 > answer.txt")
        right = traj("right")
        await score_trajectory_async(right, scoring, box)
        await box.exec("echo 41 > answer.txt")
        wrong = traj("wrong")
        await score_trajectory_async(wrong, scoring, box)
        await provider.close()
        return right, wrong

    right, wrong = asyncio.run(scenario())
    assert right.score == 1.0 and right.status == TrajectoryStatus.COMPLETED
    assert wrong.score == 0.0 and "41" in wrong.reward.reason
