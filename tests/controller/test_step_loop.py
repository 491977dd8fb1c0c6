"""The controller's synchronous step without Ray: collect (refill and filters), learn
(StepAlgorithm: corrections, KL in the reward), weight targets, colocation phase order."""

from __future__ import annotations

import time

import pytest
import torch

from loongsage_core.controller.batching import build_batch


def test_two_steps_train_and_report_the_step_metrics(controller_factory):
    c = controller_factory()
    history = [c.run_step(0), c.run_step(1)]
    for m in history:
        assert m["rollout/groups_trained"] == 2.0 and m["rollout/num_rows"] == 8.0
        assert m["rollout/reward_mean"] == pytest.approx(0.5)  # even samples right, odd ones wrong
        assert m["train/num_mini_batches"] == 1.0 and m["train/adv_abs_mean"] > 0
        assert m["train/is_approx_k3_kl"] > 1e-4  # the fake engine's log-probs are not the trainer's
    assert c.run.version == 2
    assert c.events.count("trainer.train") == 2
    assert [e for e in c.events if e.startswith("trainer.push")] == ["trainer.push:1", "trainer.push:2"]
    norm = c.trainer.norms[0]
    assert norm.num_sequences == 8.0 and norm.num_tokens > 8


@pytest.mark.parametrize("correction", ["tis", "m2po"])
def test_pre_advantage_corrections_run_in_a_real_step_and_change_the_loss(controller_factory, correction):
    # regression: `algorithm.corrections = ["tis"]` crashed at the first train step
    args = {"tis": {"upper": 1.5}, "m2po": {"tau": 0.002}}[correction]
    plain = controller_factory({"algorithm": {"force_old_logprob_pass": True}})  # the gap from the same pass
    corrected = controller_factory({"algorithm": {"corrections": [correction], "correction_args": {correction: args}}})
    groups, _, _ = plain.collect(0)
    base, _ = plain.run.learner.learn(groups, 0)
    fixed, _ = corrected.run.learner.learn(groups, 0)
    if correction == "m2po":  # the largest (old - rollout)^2 tokens are masked
        assert 0.0 < fixed["train/correction_kept_ratio"] < 1.0
    else:  # the per-step IS metrics are reported
        assert 0.0 < fixed["train/is_weight_mean"] < 1.5
    # the same rows, the same start: only the correction changes the update
    assert fixed["train/grad_norm"] != pytest.approx(base["train/grad_norm"], rel=1e-4)
    assert fixed["train/is_approx_k3_kl"] == base["train/is_approx_k3_kl"]  # the same rows, one gap
    corrected.run_step(1)  # and the loop goes on


def test_kl_in_the_reward_changes_the_advantages_of_grpo(controller_factory):
    # regression: kl_in_reward with grpo / dr_grpo / rloo was accepted and had no effect
    kl = {"kl": "k1", "kl_coef": 0.5}
    in_reward = controller_factory({"algorithm": {**kl, "kl_in_reward": True}})
    in_loss_free = controller_factory({"algorithm": {**kl, "kl_coef": 0.0}})  # a KL with no weight: none
    assert in_reward.run.needs_reference and in_reward.run.algorithm.kl is not None
    groups0, _, _ = in_reward.collect(0)
    first, _ = in_reward.run.learner.learn(groups0, 0)
    same, _ = in_loss_free.run.learner.learn(groups0, 0)
    # the reference starts as the policy: no penalty yet, the same update
    assert first["train/reward_kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["train/adv_abs_mean"] == pytest.approx(same["train/adv_abs_mean"], rel=1e-6)
    groups1, _, _ = in_reward.collect(1)
    batch = build_batch(groups1)
    second, _ = in_reward.run.learner.learn(groups1, 1)
    other, _ = in_loss_free.run.learner.learn(groups1, 1)
    assert abs(second["train/reward_kl"]) > 1e-4
    assert second["train/adv_abs_mean"] != pytest.approx(other["train/adv_abs_mean"], rel=1e-5)
    assert len(batch) == 8


def test_filters_drop_groups_and_the_loop_refills_them(controller_factory):
    calls = {"n": 0}

    def responder(prompt_text, sample):
        calls["n"] += 1
        if calls["n"] <= 8:  # the first two prompts: every sample wrong -> no signal
            return "The answer is 1000", "stop"
        return ("The answer is 1000", "stop") if sample % 2 else (_right(prompt_text), "stop")

    c = controller_factory({"algorithm": {"filters": ["dynamic_sampling"], "max_filter_retries": 3}},
                           responder=responder)
    groups, _, metrics = c.collect(0)
    assert len(groups) == 2 and all(len(set(g.scores)) > 1 for g in groups)
    assert metrics["rollout/filter_drop"] == 2.0 and metrics["rollout/filter_attempts"] == 2.0
    assert metrics["rollout/num_trajectories"] == 16.0  # every sampled trajectory is in the rollout metrics


def _right(prompt_text: str) -> str:
    import re

    m = re.search(r"What is ([-+ 0-9]+)\?", prompt_text)
    return f"The answer is {eval(m.group(1))}"  # noqa: S307


def test_filters_give_up_after_max_retries(controller_factory):
    c = controller_factory({"algorithm": {"filters": ["dynamic_sampling"], "max_filter_retries": 1}},
                           responder=lambda text, sample: ("The answer is 1000", "stop"))
    groups, _, metrics = c.collect(0)
    assert groups == [] and metrics["rollout/filter_attempts"] == 2.0 and metrics["rollout/filter_drop"] == 4.0
    train, tokens = c.run.learner.learn(groups, 0)
    assert tokens == 0.0 and train["rollout/num_rows"] == 0.0
    assert set(train) == {"rollout/num_rows", "timing/controller_overhead"}  # nothing was trained


class TargetRecorder:
    def __init__(self, log):
        self.log = log

    def push_weights(self, version, targets):
        self.log.append((version, targets))
        return {"seconds": 0.0}


@pytest.mark.parametrize("colocated", [False, True])
def test_weight_targets(controller_factory, colocated):
    from loongsage_core.controller.placement import Actors
    from loongsage_core.controller.remote import LocalActor

    c = controller_factory()
    log = []
    ranks = [LocalActor(TargetRecorder(log)) for _ in range(3)]
    engines = ranks[:2] if colocated else [object(), object()]
    c.run.actors = Actors(trainers=ranks, engine_actors=engines, engine_urls=["http://e0", "http://e1"],
                      colocated=colocated, dp_ranks=[0, 1, 2], dp_size=3)
    c.run.push_weights(4)
    if colocated:  # rank i feeds its own engine i in-process; rank 2 has none but still joins
        assert log == [(4, None), (4, None), (4, [])]
    else:  # rank 0 feeds every engine; the others join the collective read
        assert log == [(4, ["http://e0", "http://e1"]), (4, []), (4, [])]


def test_colocated_phases_hand_over_the_devices_in_order(controller_factory):
    c = controller_factory({"placement": {"colocate": True, "offload": True},
                            "rollout": {"weight_transport": "inprocess"}})
    c.run.phases.to_generation()
    c.events.clear()
    c.run_step(0)
    order = [e for e in c.events if not e.startswith("trainer.train")]
    assert order == ["engine0.release:kv_cache,weights", "trainer.onload", "engine0.resume_memory:weights",
                     "trainer.push:1", "trainer.offload", "engine0.resume_memory:kv_cache"]
    assert c.events.index("trainer.train") == 2  # trained between the onload and the weight sync
    assert torch.isfinite(torch.tensor(c.trainer.norms[0].num_tokens))


def test_the_controller_overhead_leaves_out_the_time_spent_waiting_on_actors(controller_factory):
    c = controller_factory()
    trainer = c.run.actors.trainers[0].obj
    train_mini_batch = trainer.train_mini_batch

    def slow_train_mini_batch(batch, norm):  # one second of the actor's work, which the controller waits for
        time.sleep(1.0)
        return train_mini_batch(batch, norm)

    trainer.train_mini_batch = slow_train_mini_batch
    m = c.run_step(0)
    after_rollout = m["timing/step"] - m["timing/rollout"]
    assert after_rollout > 1.0
    # the controller's own work: more than nothing, less than what followed the rollout minus the wait
    assert 0.0 < m["timing/controller_overhead"] < after_rollout - 0.9
    assert m["perf/controller_overhead_ratio"] == pytest.approx(m["timing/controller_overhead"] / m["timing/step"])


def test_own_time_counts_a_block_less_its_waits_once():
    from loongsage_core.controller.remote import LocalActor, gather, own_time, waiting

    class Sleeper:
        def nap(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    actor, into = LocalActor(Sleeper()), {}
    with own_time(into, "own"):
        time.sleep(0.05)  # the block's own work
        with waiting():  # nested: counted once
            assert gather([actor.nap.remote(0.5), actor.nap.remote(0.5)]) == [0.5, 0.5]
    assert 0.05 <= into["own"] < 0.5
