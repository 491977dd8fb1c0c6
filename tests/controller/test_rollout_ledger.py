"""The async loop's ledger: waste (tokens generated and never trained) and the sampled vs trained
response-length check, which must flag a run that drops its long generations."""

from __future__ import annotations

import collections
import random

import pytest

from loongsage_core.controller.rollout_ledger import RolloutLedger, ks_distance, quantile
from loongsage_hookspecs import Segment, Trajectory, TrajectoryGroup, TrajectoryStatus


def group(gid: str, lengths: list[int]) -> TrajectoryGroup:
    trajs = []
    for j, n in enumerate(lengths):
        seg = Segment()
        seg.append([1, 2], generated=False)
        seg.append([3] * n, generated=True, logprobs=[-0.5] * n, weight_version=0)
        trajs.append(Trajectory(id=f"{gid}-{j}", prompt_id=gid, group_id=gid, segments=[seg],
                                status=TrajectoryStatus.COMPLETED))
    return TrajectoryGroup(group_id=gid, prompt_id=gid, trajectories=trajs)


def heavy_tailed(n: int, seed: int = 0) -> list[TrajectoryGroup]:
    """Groups of 4 samples whose lengths follow the benchmark's sources: 8/32/96/256 tokens with
    weights 0.55/0.25/0.15/0.05."""
    rng = random.Random(seed)
    return [group(f"g{i}", [rng.choices([8, 32, 96, 256], [0.55, 0.25, 0.15, 0.05])[0]] * 4) for i in range(n)]


def test_training_everything_is_unbiased_and_wastes_nothing():
    ledger = RolloutLedger()
    groups = heavy_tailed(200)
    for g in groups:
        ledger.finished(g)
    ledger.trained(groups)
    m = ledger.metrics()
    assert m["rollout/waste_ratio"] == 0.0 and m["rollout/length_ks"] == 0.0
    assert m["rollout/length_trained_mean"] == m["rollout/length_sampled_mean"] > 8
    assert m["rollout/generated_tokens_total"] == sum(len(g.trajectories) * g.trajectories[0].response_length
                                                      for g in groups)


def test_dropping_the_long_generations_is_flagged_and_counted_as_waste():
    # what an eviction by staleness does on a heavy tail: the slowest (longest) groups are lost
    ledger = RolloutLedger()
    groups = heavy_tailed(400, seed=1)
    for g in groups:
        ledger.finished(g)
    long = [g for g in groups if g.trajectories[0].response_length >= 96]
    kept = [g for g in groups if g.trajectories[0].response_length < 96]
    for g in long[::2]:  # half of the long ones dropped, the other half trained
        ledger.dropped(g)
    ledger.trained(kept + long[1::2])
    m = ledger.metrics()
    wasted = sum(4 * g.trajectories[0].response_length for g in long[::2])
    generated = sum(4 * g.trajectories[0].response_length for g in groups)
    assert m["rollout/wasted_tokens_total"] == wasted
    assert m["rollout/waste_ratio"] == pytest.approx(wasted / generated)
    assert m["rollout/waste_ratio"] > 0.2
    assert m["rollout/length_trained_mean"] < 0.9 * m["rollout/length_sampled_mean"]
    assert m["rollout/length_ks"] > 0.05  # above the benchmark's limit for "unbiased"


def test_undecided_groups_count_in_neither_distribution():
    ledger = RolloutLedger()
    short, tail = group("a", [8, 8]), group("b", [256, 256])
    ledger.finished(short)
    ledger.finished(tail)  # still buffered at the end of the run: neither trained nor dropped
    ledger.trained([short])
    ledger.aborted()
    m = ledger.metrics()
    assert m["rollout/length_sampled_mean"] == m["rollout/length_trained_mean"] == 8.0
    assert m["rollout/generated_tokens_total"] == 528.0 and m["rollout/waste_ratio"] == 0.0
    assert m["rollout/aborted_groups_total"] == 1.0


def test_ks_distance_and_quantile():
    a = collections.Counter({1: 1, 2: 1, 3: 1, 4: 1})
    assert ks_distance(a, a) == 0.0
    assert ks_distance(a, collections.Counter({5: 3})) == 1.0
    assert ks_distance(a, collections.Counter({1: 1, 2: 1})) == pytest.approx(0.5)
    assert ks_distance(a, collections.Counter()) == 0.0
    assert quantile(a, 0.5) == 2.0 and quantile(a, 0.9) == 4.0 and quantile(collections.Counter(), 0.9) == 0.0
