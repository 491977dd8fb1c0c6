"""Group filters, the overlong reward and the rollout metric helpers."""

from __future__ import annotations

import copy

import pytest
import torch
from loongsage_plugin_rl import adv_zero_ratio, rollout_group_metrics
from loongsage_plugin_rl import filters as flt
from loongsage_plugin_rl.reward_shaping import overlong_penalty

from loongsage_hookspecs import Reward, Segment, Trajectory, TrajectoryGroup, TrajectoryStatus


def traj(gid, k, score, finish="stop", status=TrajectoryStatus.COMPLETED, generated=3):
    seg = Segment()
    seg.append([1, 2], generated=False)
    seg.append(list(range(generated)), generated=True, logprobs=[-0.5] * generated, weight_version=0)
    return Trajectory(id=f"{gid}-{k}", prompt_id=f"p{gid}", group_id=f"g{gid}", segments=[seg],
                      status=status, finish_reason=finish, reward=Reward(score=score))


def group(gid, *trajs):
    return TrajectoryGroup(group_id=f"g{gid}", prompt_id=f"p{gid}", source="math", trajectories=list(trajs))


def ids(groups):
    return [[t.id for t in g.trajectories] for g in groups]


def test_dynamic_sampling_drops_groups_without_spread():
    groups = [
        group(0, traj(0, 0, 1.0), traj(0, 1, 1.0)),  # all correct
        group(1, traj(1, 0, 0.0), traj(1, 1, 1.0)),
        group(2, traj(2, 0, 0.0), traj(2, 1, 0.0), traj(2, 2, 0.0)),  # all wrong
        group(3, traj(3, 0, 0.5)),  # a single trajectory
        group(4),  # empty
        group(5, traj(5, 0, 0.2), traj(5, 1, 0.25)),
    ]
    before = copy.deepcopy(groups)
    kept = flt.dynamic_sampling(groups)
    assert [g.group_id for g in kept] == ["g1", "g5"]
    assert groups == before  # input untouched
    assert [g.group_id for g in flt.dynamic_sampling(groups, min_spread=0.1)] == ["g1"]
    with pytest.raises(ValueError, match="dynamic_sampling: argument 'min_spread' must be >= 0.0"):
        flt.dynamic_sampling(groups, min_spread=-1)


def test_overlong_trajectory_and_group_modes():
    groups = [
        group(0, traj(0, 0, 1.0), traj(0, 1, 0.0, finish="length"), traj(0, 2, 0.0)),
        group(1, traj(1, 0, 1.0, finish="length")),
        group(2, traj(2, 0, 1.0), traj(2, 1, 1.0, finish="abort")),
    ]
    before = copy.deepcopy(groups)
    by_traj = flt.overlong(groups)
    assert ids(by_traj) == [["0-0", "0-2"], ["2-0", "2-1"]]
    assert by_traj[0].group_id == "g0" and by_traj[0].source == "math"
    assert by_traj[1] is groups[2]
    assert ids(flt.overlong(groups, mode="group")) == [["2-0", "2-1"]]
    assert groups == before
    with pytest.raises(ValueError, match="overlong: argument 'mode' must be one of \\['trajectory', 'group'\\]"):
        flt.overlong(groups, mode="row")


def test_status_filter():
    groups = [
        group(0, traj(0, 0, 1.0), traj(0, 1, 0.0, status=TrajectoryStatus.FAILED)),
        group(1, traj(1, 0, 0.0, status=TrajectoryStatus.ABORTED), traj(1, 1, 0.0, status="failed")),
        group(2, traj(2, 0, 1.0), traj(2, 1, 0.5)),
    ]
    kept = flt.status(groups)
    assert ids(kept) == [["0-0"], ["2-0", "2-1"]]
    assert kept[1] is groups[2] and len(groups[0]) == 2


def test_filters_reject_wrong_inputs():
    with pytest.raises(TypeError, match="status: expected a list of TrajectoryGroup"):
        flt.status(group(0))
    with pytest.raises(TypeError, match="overlong: groups\\[1\\] is dict"):
        flt.overlong([group(0), {}])
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        flt.status([], mode="group")


@pytest.mark.parametrize(("length", "expected"), [(0, 0.0), (60, 0.0), (61, -0.05), (70, -0.5), (80, -1.0),
                                                  (81, -1.0), (500, -1.0)])
def test_overlong_penalty_ramp(length, expected):
    t = traj(0, 0, 1.0, generated=length)
    assert t.response_length == length
    out = overlong_penalty(t, max_len=80, cache_len=20)
    assert isinstance(out, Reward)
    assert out.score == pytest.approx(expected)
    assert out.details == {"overlong_penalty": out.score}
    assert overlong_penalty(t, max_len=80, cache_len=20, factor=0.5).score == pytest.approx(0.5 * expected)


def test_overlong_penalty_hard_cutoff_and_errors():
    assert overlong_penalty(traj(0, 0, 1.0, generated=80), max_len=80, cache_len=0).score == 0.0
    assert overlong_penalty(traj(0, 0, 1.0, generated=81), max_len=80, cache_len=0).score == -1.0
    t = traj(0, 0, 1.0)
    with pytest.raises(ValueError, match="'cache_len' must be in \\[0, max_len=80\\]"):
        overlong_penalty(t, max_len=80, cache_len=81)
    with pytest.raises(TypeError, match="'max_len' must be an integer"):
        overlong_penalty(t, max_len=80.5, cache_len=8)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'cache_len'"):
        overlong_penalty(t, max_len=80)


def test_rollout_group_metrics():
    groups = [
        group(0, traj(0, 0, 1.0), traj(0, 1, 1.0)),
        group(1, traj(1, 0, 0.0), traj(1, 1, 1.0)),
        group(2, traj(2, 0, 0.3), traj(2, 1, 0.2)),
        group(3, traj(3, 0, 0.0)),
        group(4),
    ]
    m = rollout_group_metrics(groups)
    assert m == {"rollout/all_correct_ratio": 0.25, "rollout/all_wrong_ratio": 0.5}
    assert rollout_group_metrics(groups, correct_threshold=0.2) == {
        "rollout/all_correct_ratio": 0.5, "rollout/all_wrong_ratio": 0.25}
    assert rollout_group_metrics([]) == {"rollout/all_correct_ratio": 0.0, "rollout/all_wrong_ratio": 0.0}


def test_adv_zero_ratio():
    advantages = torch.tensor([[0.0, 1.0, 0.0], [0.0, -2.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert adv_zero_ratio(advantages, mask) == pytest.approx(2 / 5)
    assert adv_zero_ratio(advantages, torch.zeros_like(mask)) == 0.0
