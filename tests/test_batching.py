"""Rows from trajectory groups: padding, group indices, and masking the stale prefix of partial rollouts."""

from __future__ import annotations

from loongsage_core.controller.batching import build_batch, shard_rows
from loongsage_hookspecs import Reward, Segment, Trajectory, TrajectoryGroup, TrajectoryStatus


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


def test_shards_are_contiguous_and_balanced():
    assert shard_rows(5, 2) == [[0, 1, 2], [3, 4]]
    assert shard_rows(2, 3) == [[0], [1], []]


def test_per_step_files_keep_only_steps_before_the_first_one_of_a_run(tmp_path):
    from loongsage_core.controller.run import truncate_jsonl

    path = tmp_path / "trained_prompts.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "cut sh')
    truncate_jsonl(path, 2)  # resumed at step 2: steps 2.. are redone; the half-written line goes
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'
    truncate_jsonl(path, 0)  # a fresh run into an old directory starts empty
    assert path.read_text() == ""
    truncate_jsonl(tmp_path / "missing.jsonl", 0)  # nothing to do
