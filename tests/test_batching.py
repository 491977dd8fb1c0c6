"""Rows from trajectory groups: padding, group indices, and masking the stale prefix of partial rollouts."""

from __future__ import annotations

import pytest

from loongsage_core.controller.batching import build_batch, shard_rows
from loongsage_hookspecs import Reward, RoutedExperts, Segment, Trajectory, TrajectoryGroup, TrajectoryStatus


def traj(tid: str, prompt: list[int], spans: list[tuple[list[int], int]], score: float,
         status: TrajectoryStatus = TrajectoryStatus.COMPLETED) -> Trajectory:
    seg = Segment()
    seg.append(prompt, generated=False)
    for tokens, version in spans:
        seg.append(tokens, generated=True, logprobs=[-0.5] * len(tokens), weight_version=version)
    return Trajectory(id=tid, prompt_id="p", group_id="g", segments=[seg], reward=Reward(score=score),
                      status=status)


def test_rows_padding_and_groups():
    g0 = TrajectoryGroup("g0", "p0", trajectories=[traj("a", [1, 2], [([5, 6, 7], 0)], 1.0),
                                                   traj("b", [1, 2], [([5], 0)], 0.0)])
    g1 = TrajectoryGroup("g1", "p1", trajectories=[traj("c", [3], [([8, 9], 0)], 0.5),
                                                   traj("d", [3], [([9], 0)], 0.0, TrajectoryStatus.FAILED)])
    batch = build_batch([g0, g1], pad_id=0)
    assert len(batch) == 3  # the failed trajectory is not trained on
    assert batch["input_ids"].tolist() == [[1, 2, 5, 6, 7], [1, 2, 5, 0, 0], [3, 8, 9, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 1, 1, 0, 0]]
    assert batch["group_index"].tolist() == [0, 0, 1]
    assert batch["rewards"].tolist() == [1.0, 0.0, 0.5]
    assert batch.meta["trajectory_id"] == ["a", "b", "c"]


def test_stale_prefix_of_a_partial_rollout_can_be_masked():
    # generated under version 3, then continued under version 4 after a weight update
    g = TrajectoryGroup("g", "p", trajectories=[traj("a", [1], [([5, 6], 3), ([7, 8], 4)], 1.0)])
    kept = build_batch([g])
    masked = build_batch([g], mask_stale=True)
    assert kept["loss_mask"].tolist() == [[0, 1, 1, 1, 1]]
    assert masked["loss_mask"].tolist() == [[0, 0, 0, 1, 1]]
    assert masked["weight_versions"].tolist() == [[-1, 3, 3, 4, 4]]


def test_routed_experts_become_an_int16_tensor_aligned_with_the_tokens():
    a, b = traj("a", [1, 2], [([5, 6, 7], 0)], 1.0), traj("b", [1, 2], [([5], 0)], 0.0)
    c = traj("c", [3], [([8], 0)], 0.0)
    # the engine ran every token but the last: 4 of a's 5 tokens, 2 of b's 3; width = 2 layers x top-2
    a.segments[0].record_routes(RoutedExperts(4, list(range(16))))
    b.segments[0].record_routes(RoutedExperts(4, [9] * 8))
    batch = build_batch([TrajectoryGroup("g", "p", trajectories=[a, b, c])])
    routes = batch["routed_experts"]
    assert routes.dtype.is_floating_point is False and routes.element_size() == 2
    assert routes.shape == (3, 5, 4)
    assert routes[0, :4].flatten().tolist() == list(range(16)) and routes[0, 4].tolist() == [-1] * 4
    assert routes[1, :2].flatten().tolist() == [9] * 8 and bool((routes[1, 2:] == -1).all())
    assert bool((routes[2] == -1).all())  # a segment without a record: the trainer routes on its own
    assert "routed_experts" not in build_batch([TrajectoryGroup("g", "p", trajectories=[c])])
    other = traj("d", [1], [([2], 0)], 0.0)
    other.segments[0].record_routes(RoutedExperts(6, [0] * 6))
    with pytest.raises(ValueError, match=r"\[4, 6\] ids per token: they were recorded from different models"):
        build_batch([TrajectoryGroup("g", "p", trajectories=[a, other])])


def test_shards_are_contiguous_and_balanced():
    assert shard_rows(5, 2) == [[0, 1, 2], [3, 4]]
    assert shard_rows(2, 3) == [[0], [1], []]


def test_per_step_files_keep_only_steps_before_the_first_one_of_a_run(tmp_path):
    from loongsage_core.run_files.run_dir import truncate_jsonl

    path = tmp_path / "trained_prompts.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "cut sh')
    truncate_jsonl(path, 2)  # resumed at step 2: steps 2.. are redone; the half-written line goes
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'
    truncate_jsonl(path, 0)  # a fresh run into an old directory starts empty
    assert path.read_text() == ""
    truncate_jsonl(tmp_path / "missing.jsonl", 0)  # nothing to do
