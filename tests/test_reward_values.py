"""A reward that returns something that is not a usable score (``nan``, ``inf``, ``1e308``,
``None``, ``'yes'``, ``[1.0]``) fails its trajectory with the reward's name and the value, as a
reward that raises does; the run goes on and trains the other trajectories."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from loongsage_core.config import DataConfig, JobConfig
from loongsage_core.controller.reward_values import MAX_ABS_REWARD, checked_score
from loongsage_core.controller.rewards import SourceRewards, score_trajectory
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import Trajectory, TrajectoryStatus

MODULE = '''
from loongsage_hookspecs import Reward, RewardSpec, hookimpl

VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge": 1e308, "none": None,
          "yes": "yes", "list": [1.0], "dict": {"score": 1.0}}


def returns(traj, value):
    return VALUES[value]


def detail(traj, value):
    return Reward(score=1.0, details={"judge_prob": VALUES[value]})


def half_nan(traj):
    """nan for the odd samples of each group, the answer's length for the others."""
    return float("nan") if int(traj.id.replace(":", "-").rsplit("-", 1)[-1]) % 2 else len(traj.response_text) / 10


@hookimpl
def loongsage_rewards():
    yield RewardSpec(name="returns", fn=returns)
    yield RewardSpec(name="detail", fn=detail)
    yield RewardSpec(name="half_nan", fn=half_nan)
'''

BAD = {"nan": "returned nan", "inf": "returned inf", "-inf": "returned -inf", "huge": "returned 1e+308",
       "none": "returned None (NoneType), not a number", "yes": "returned 'yes' (str), not a number",
       "list": "returned [1.0] (list), not a number", "dict": "returned {'score': 1.0} (dict), not a number"}


def host(tmp_path: Path) -> PluginHost:
    (tmp_path / "odd_rewards.py").write_text(MODULE)
    return PluginHost.create(modules=[str(tmp_path / "odd_rewards.py")], entry_points=False)


def score(t: Trajectory, components: PluginHost, source: DataConfig) -> None:
    """Score ``t`` with ``source``'s rewards, bound as a run binds them."""
    score_trajectory(t, SourceRewards.bind(JobConfig(data=[source]), source, "data[0]", components))


def completed(tid: str = "0-0-0") -> Trajectory:
    t = Trajectory(id=tid, prompt_id="p", group_id="g", prompt="x", response_text="12")
    t.status = TrajectoryStatus.COMPLETED
    return t


@pytest.mark.parametrize("value", sorted(BAD))
def test_an_unusable_score_fails_the_trajectory_naming_reward_and_value(tmp_path, value):
    components = host(tmp_path)
    t = completed()
    score(t, components, DataConfig(name="s", reward=["returns"], reward_args={"returns": {"value": value}}))
    assert t.status == TrajectoryStatus.FAILED and t.metadata["failed_in"] == "reward"
    assert t.error.startswith("reward 'returns' ") and BAD[value] in t.error, t.error
    assert t.reward.score == 0.0 and t.reward.error == t.error


@pytest.mark.parametrize("value", ["nan", "none", "yes"])
def test_an_unusable_detail_fails_the_trajectory_naming_it(tmp_path, value):
    components = host(tmp_path)
    t = completed()
    score(t, components, DataConfig(name="s", reward=["detail"], reward_args={"detail": {"value": value}}))
    assert t.status == TrajectoryStatus.FAILED
    assert t.error.startswith("reward 'detail/judge_prob' ") and BAD[value] in t.error, t.error


def test_numbers_of_every_kind_within_the_bound_are_scores():
    assert checked_score("r", True) == 1.0 and checked_score("r", 3) == 3.0
    assert checked_score("r", np.float32(0.5)) == 0.5 and checked_score("r", torch.tensor(-2.0)) == -2.0
    assert checked_score("r", MAX_ABS_REWARD) == MAX_ABS_REWARD and checked_score("r", -MAX_ABS_REWARD) == -1e6
    with pytest.raises(ValueError, match=r"reward 'r' returned 1000000\.5: a score must be finite with "
                                         r"\|score\| <= 1e\+06"):
        checked_score("r", MAX_ABS_REWARD + 0.5)
    with pytest.raises(ValueError, match="not one number"):
        checked_score("r", torch.tensor([1.0, 2.0]))
    assert math.isfinite(checked_score("r", np.int64(7)))


def test_a_run_whose_reward_returns_nan_for_half_the_samples_trains_on_the_rest(ray_cluster, tiny_job, tmp_path):
    (tmp_path / "odd_rewards.py").write_text(MODULE)
    out = tmp_path / "run"
    history = tiny_job.run(tmp_path, out, "data.0.reward=half_nan", 'plugins.modules=["odd_rewards.py"]',
                           "train.total_steps=2", "run.checkpoint_every=0")
    assert [m["step"] for m in history] == [0, 1]
    assert all(m["rollout/failed_ratio"] == 0.5 and m["fault/bad_step"] == 0.0 for m in history)
    assert all(math.isfinite(m["train/loss"]) and m["rollout/num_rows"] == 4.0 for m in history)
    with gzip.open(out / "rollouts" / "step_000000.jsonl.gz", "rt") as f:
        records = [json.loads(line) for line in f]
    failed = [r for r in records if r["status"] == "failed"]
    assert len(failed) == 4 and all(r["error"] == "reward 'half_nan' returned nan: a score must be finite with "
                                                  "|score| <= 1e+06" for r in failed)
