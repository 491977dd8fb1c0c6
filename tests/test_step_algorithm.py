"""StepAlgorithm on hand-made rows with the real rl components: trajectories in several segments,
penalties in the reward for every estimator, one set of mini-batch norms."""

from __future__ import annotations

import pytest
import torch

from loongsage_core.algorithms import StepAlgorithm, compute_norm
from loongsage_core.config import structure_job
from loongsage_core.controller.batching import build_batch
from loongsage_core.controller.metrics import rollout_metrics
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import Reward, Segment, Trajectory, TrajectoryGroup, TrajectoryStatus


def job(**algorithm):
    return structure_job({"plugins": {"enable": ["rl"]}, "algorithm": algorithm,
                          "data": [{"name": "a", "path": "x.jsonl"}]}, source="job.toml")


@pytest.fixture(scope="module")
def host():
    return PluginHost.from_job(job())


def segment(prompt: list[int], answer: list[int]) -> Segment:
    seg = Segment()
    seg.append(prompt, generated=False)
    seg.append(answer, generated=True, logprobs=[-1.0] * len(answer), weight_version=0)
    return seg


def trajectory(tid: str, score: float, segments: int, source: str = "a") -> Trajectory:
    segs = [segment([1, 2], [5 + i, 6]) for i in range(segments)]
    return Trajectory(id=tid, prompt_id="p", group_id="g", source=source, segments=segs, reward=Reward(score=score),
                      status=TrajectoryStatus.COMPLETED)


def step_rows(batch):
    batch.tensors["old_logprobs"] = batch["rollout_logprobs"].clone()
    return batch


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_a_trajectory_in_three_segments_counts_once_and_every_segment_gets_its_advantage(host, advantage):
    # the right answer was split into three segments (a rewritten context); two wrong ones are whole
    split = [TrajectoryGroup("g0", "p", trajectories=[trajectory("right", 1.0, 3), trajectory("w1", 0.0, 1),
                                                      trajectory("w2", 0.0, 1)])]
    whole = [TrajectoryGroup("g0", "p", trajectories=[trajectory("right", 1.0, 1), trajectory("w1", 0.0, 1),
                                                      trajectory("w2", 0.0, 1)])]
    b_split, b_whole = step_rows(build_batch(split)), step_rows(build_batch(whole))
    assert b_split["sample_index"].tolist() == [0, 0, 0, 1, 2]
    algo = StepAlgorithm.from_job(job(advantage=advantage), host)
    algo.prepare(b_split)
    algo.prepare(b_whole)
    adv_split = [row[row != 0].unique().tolist() for row in b_split["advantages"]]
    adv_whole = [row[row != 0].unique().tolist() for row in b_whole["advantages"]]
    assert adv_split[0] == adv_split[1] == adv_split[2]  # broadcast onto every segment
    assert adv_split[0][0] > 0 > adv_split[3][0]
    if advantage != "reinforce_pp_baseline":  # (its whitening spans the tokens, which differ in number)
        assert adv_split[0] == pytest.approx(adv_whole[0]) and adv_split[3] == pytest.approx(adv_whole[1])
    # the dynamic-sampling filter and the rollout metrics see trajectories, not rows
    kept = host.get("filter", "dynamic_sampling").fn(split)
    assert kept == split
    assert rollout_metrics(split)["rollout_per_source/a/count"] == 3.0


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_kl_in_the_reward_changes_the_advantages_of_every_estimator(host, advantage):
    groups = [TrajectoryGroup("g0", "p", trajectories=[trajectory(f"t{i}", float(i % 2), 1) for i in range(4)])]
    plain = step_rows(build_batch(groups))
    plain.tensors["ref_logprobs"] = plain["old_logprobs"] - 0.3 * torch.arange(4.0)[:, None] * plain["loss_mask"]
    folded = build_batch(groups)
    folded.tensors.update({k: plain[k].clone() for k in ("old_logprobs", "ref_logprobs")})
    StepAlgorithm.from_job(job(advantage=advantage), host).prepare(plain)
    folding = StepAlgorithm.from_job(job(advantage=advantage, kl="k1", kl_coef=0.5, kl_in_reward=True), host)
    metrics = folding.prepare(folded)
    assert metrics["train/reward_kl"] == pytest.approx(0.45)  # k1 = old - ref = 0.3 * row, mean over rows
    assert not torch.allclose(plain["advantages"], folded["advantages"])


def test_mini_batches_carry_the_one_norm_and_skip_rows_without_tokens(host):
    groups = [TrajectoryGroup("g0", "p", trajectories=[trajectory(f"t{i}", float(i % 2), 1 + i % 2) for i in range(4)])]
    batch = step_rows(build_batch(groups))
    batch.tensors["loss_mask"][0] = 0  # a row with nothing to train
    algo = StepAlgorithm.from_job(job(), host)
    minis = list(algo.mini_batches(batch, [0, 1, 2, 3, 4, 5], 2))
    assert [len(m) for m, _ in minis] == [2, 2, 2]
    for mini, norm in minis:
        assert norm == compute_norm(mini)
    only_empty = list(algo.mini_batches(batch, [0], 1))
    assert only_empty == []


def test_pre_advantage_correction_metrics_and_missing_inputs_are_clear(host):
    groups = [TrajectoryGroup("g0", "p", trajectories=[trajectory(f"t{i}", float(i % 2), 1) for i in range(4)])]
    batch = step_rows(build_batch(groups))
    batch.tensors["old_logprobs"] = batch["old_logprobs"] + 0.5 * batch["loss_mask"] * torch.arange(4.0)[:, None]
    tis = StepAlgorithm.from_job(job(corrections=["tis"], correction_args={"tis": {"upper": 1.2}}), host)
    metrics = tis.prepare(batch)
    assert metrics["train/is_clip_ratio"] > 0 and "correction_weights" in batch
    assert float(batch["correction_weights"].max()) <= 1.2 + 1e-6
    assert metrics["train/is_approx_k3_kl"] > 0
    no_ref = step_rows(build_batch(groups))
    with pytest.raises(ValueError, match="ref_logprobs"):
        StepAlgorithm.from_job(job(kl="k1", kl_coef=0.1, kl_in_reward=True), host).prepare(no_ref)
