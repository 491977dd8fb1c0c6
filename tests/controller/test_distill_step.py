"""A distilling job's step without Ray: the teacher actor's code scores the rows the policy's worker
group shipped, its tensors reach the step's algorithm, and the student moves towards the teacher."""

from __future__ import annotations

import pytest

from .conftest import TINY

TEACHER = {"teachers": [{"name": "tutor", "backend": "torch",
                         "args": {"config": dict(TINY), "seed": 11, "device": "cpu"}}],
           "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip", "loss_agg": "token_mean",
                         "distill_kl": "opd_k3", "distill_coef": 1.0, "force_old_logprob_pass": True}}


def distilling_job(tutor_for_add: bool = True) -> dict:
    return {**TEACHER, "data": [{"name": "add", "generator": "arithmetic", "generator_args": {"num_samples": 32},
                                 "reward": ["exact_match"], "teacher": "tutor" if tutor_for_add else None}]}


def test_a_step_scores_rows_with_the_teacher_actor_and_trains_on_the_gap(controller_factory):
    c = controller_factory(distilling_job())
    assert c.run.teachers is not None and c.run.teachers.setup.kl_name == "opd_k3"
    groups, _, _ = c.collect(0)
    metrics, _ = c.run.learner.learn(groups, 0)
    batch = c.run.learner.last_batch
    assert batch is not None and "teacher_logprobs" in batch and "teacher_mask" in batch
    assert metrics["train/teacher_row_ratio"] == 1.0 and metrics["perf/teacher_builds"] == 1.0
    # the k3 gap the manager reports is the one between the rows' old log-probs and the teacher's
    mask = batch["loss_mask"] > 0
    gap = (batch["old_logprobs"] - batch["teacher_logprobs"])[mask].mean()
    assert metrics["train_per_teacher/tutor/opd_kl"] == pytest.approx(float(gap), rel=1e-5)
    assert metrics["train/opd_kl"] != 0.0
    # a later step reuses the built teacher
    assert c.run_step(1)["perf/teacher_builds"] == 0.0


def test_a_job_whose_sources_name_no_teacher_starts_no_teacher_actor(controller_factory):
    c = controller_factory({"teachers": TEACHER["teachers"], "data": distilling_job(tutor_for_add=False)["data"]})
    assert c.run.teachers is None
    assert "train/teacher_row_ratio" not in c.run_step(0)
