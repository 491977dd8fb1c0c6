"""The separate old-log-prob pass is skipped when one optimizer pass follows generation by the
current weights (loongsage_core/algorithms/old_logprobs.py), with the same update and the same
train-inference gap as when it runs; the rule's cases that keep it."""

from __future__ import annotations

import pytest
import torch

from loongsage_core.algorithms.old_logprobs import old_logprob_pass
from loongsage_core.controller.batching import build_batch

from .conftest import make_job


def _weights(controller) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in controller.trainer.worker.model.state_dict().items()}


def test_skipping_the_pass_gives_the_same_update_and_gap(controller_factory):
    skipped = controller_factory()
    forced = controller_factory({"algorithm": {"force_old_logprob_pass": True}})
    before = _weights(skipped)
    assert all(torch.equal(before[k], v) for k, v in _weights(forced).items())  # the same start
    groups, _, _ = skipped.collect(0)
    a, _ = skipped.run.learner.learn(groups, 0)
    b, _ = forced.run.learner.learn(groups, 0)
    assert a["perf/old_logprob_pass_skipped"] == 1.0 and b["perf/old_logprob_pass_skipped"] == 0.0
    # the training forward's log-probs are kept as the step's old log-probs (the records carry them)
    kept, scored = skipped.run.learner.last_batch, forced.run.learner.last_batch
    torch.testing.assert_close(kept["old_logprobs"], scored["old_logprobs"], rtol=1e-5, atol=1e-6)
    assert float(kept["old_logprobs"].abs().sum()) > 0
    assert torch.equal(kept["old_logprobs"] != 0, kept["loss_mask"] > 0)
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/is_approx_k3_kl",
                "train/logprob_abs_diff_mean", "train/logprob_abs_diff_max", "train/adv_abs_mean"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert a["train/is_approx_k3_kl"] > 1e-4  # the fake engine's log-probs are not the trainer's
    after_a, after_b = _weights(skipped), _weights(forced)
    moved = max(float((after_a[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-4  # the step did change the weights
    for k in before:
        torch.testing.assert_close(after_a[k], after_b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides", [
    {"train": {"ppo_epochs": 2}},                       # a second pass sees updated weights
    {"train": {"mini_batch_size": 4}},                  # two mini-batches: two optimizer steps
    {"algorithm": {"force_old_logprob_pass": True}},    # the switch
    {"algorithm": {"corrections": ["tis"]}},            # IS weights need old log-probs before training
])
def test_the_pass_runs_when_the_rule_says_so(controller_factory, overrides):
    c = controller_factory(overrides)
    metrics = c.run_step(0)
    assert metrics["perf/old_logprob_pass_skipped"] == 0.0
    assert "old_logprobs" in c.run.learner.last_batch


def test_recompute_off_uses_rollout_logprobs_and_no_pass(controller_factory):
    c = controller_factory({"algorithm": {"recompute_old_logprobs": False}})
    metrics = c.run_step(0)
    assert metrics["perf/old_logprob_pass_skipped"] == 0.0
    assert torch.equal(c.run.learner.last_batch["old_logprobs"], c.run.learner.last_batch["rollout_logprobs"])


def test_stale_samples_skip_the_pass_with_the_same_update(controller_factory):
    # the async loop trains on samples of older weights (whole groups, or a partial rollout's older
    # prefix): the pass would score them with the trainer's current weights, which is what the
    # training forward does, so skipping it gives the same update
    skipped = controller_factory()
    forced = controller_factory({"algorithm": {"force_old_logprob_pass": True}})
    groups, _, _ = skipped.collect(0)
    for c in (skipped, forced):
        c.run.version = 3  # the samples above came from version 0
    batch = build_batch(groups)
    assert int(batch["weight_versions"][batch["loss_mask"] > 0].max()) == 0
    before = _weights(skipped)
    a, _ = skipped.run.learner.learn(groups, 0)
    b, _ = forced.run.learner.learn(groups, 0)
    assert a["perf/old_logprob_pass_skipped"] == 1.0 and b["perf/old_logprob_pass_skipped"] == 0.0
    torch.testing.assert_close(skipped.run.learner.last_batch["old_logprobs"],
                               forced.run.learner.last_batch["old_logprobs"], rtol=1e-5, atol=1e-6)
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/is_approx_k3_kl"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    after_a, after_b = _weights(skipped), _weights(forced)
    assert max(float((after_a[k] - before[k]).abs().max()) for k in before) > 1e-4
    for k in before:
        torch.testing.assert_close(after_a[k], after_b[k], rtol=1e-5, atol=1e-6)


def test_needed_before_training_keeps_the_pass(controller_factory):
    c = controller_factory()
    groups, _, _ = c.collect(0)
    batch = build_batch(groups)
    run, why = old_logprob_pass(make_job(), batch, needed_before_training=True)
    assert run and "before training" in why


def test_router_replay_comparison_keeps_the_pass_and_reports_on_the_rows(controller_factory):
    from loongsage_core.algorithms import router_replay_metrics

    c = controller_factory()
    groups, _, _ = c.collect(0)
    batch = build_batch(groups)
    replay = make_job({"algorithm": {"router_replay": True}})
    assert old_logprob_pass(replay, batch, needed_before_training=False)[0] is False  # no routes
    batch.tensors["routed_experts"] = torch.zeros((*batch["input_ids"].shape, 4), dtype=torch.int16)
    run, why = old_logprob_pass(replay, batch, needed_before_training=False)
    assert run and "router_replay_compare" in why
    quiet = make_job({"algorithm": {"router_replay": True, "router_replay_compare": False}})
    assert old_logprob_pass(quiet, batch, needed_before_training=False)[0] is False

    # agreement over the tokens with a record (-1: none, padding never counts); the unreplayed gap
    # over the loss mask, against the rollout log-probs
    real, mask = batch["attention_mask"] > 0, batch["loss_mask"] > 0
    agreement = torch.where(real, 1.0, -1.0)
    agreement[0, 0], agreement[0, 1] = 0.5, -1.0
    shifted = batch["rollout_logprobs"] + 0.1 * mask
    out = router_replay_metrics(batch, {"router_agreement": torch.where(real, 1.0, -1.0),
                                        "router_agreement_no_replay": agreement, "logprobs_no_replay": shifted})
    measured = int(real.sum()) - 1
    assert out["train/router_agreement"] == 1.0
    assert out["train/router_agreement_no_replay"] == pytest.approx((measured - 0.5) / measured)
    assert out["train/is_approx_k3_kl_no_replay"] == pytest.approx(float(torch.tensor(0.1).double().expm1() - 0.1),
                                                                    rel=1e-5)  # r is a float32 difference
    assert out["train/logprob_abs_diff_max_no_replay"] == pytest.approx(0.1)
    assert router_replay_metrics(batch, {}) == {}


def test_maximum_metrics_take_the_largest_micro_batch_value():
    from loongsage_core.algorithms.metrics import Maximum, MetricAccumulator

    acc = MetricAccumulator()
    mask = torch.ones(1, 2)
    acc.add({"gap_max": Maximum(torch.tensor([0.5, 2.0])), "gap": torch.tensor([[1.0, 3.0]])}, mask)
    acc.add({"gap_max": Maximum(1.5), "gap": torch.tensor([[5.0, 7.0]])}, mask)
    assert acc.result() == {"train/gap_max": 2.0, "train/gap": 4.0}
