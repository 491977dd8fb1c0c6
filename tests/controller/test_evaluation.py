"""Held-out evaluation in the loop (``[eval]``): when it runs, what it reports, and that it trains
nothing and draws nothing from the training data."""

from __future__ import annotations

import json

import pytest
import torch

from loongsage_core.controller.evaluation import ks_up_to, pass_at_k

EVAL = {"data": [{"name": "held", "generator": "arithmetic", "generator_args": {"num_samples": 6, "seed": 11},
                  "reward": ["exact_match"]}],
        "every": 2, "samples": 4}


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 3) == 1.0
    assert pass_at_k(4, 2, 1) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 4, 2) == 1.0  # fewer wrong answers than draws: a right one is always drawn
    assert ks_up_to(1) == [1] and ks_up_to(4) == [1, 2, 4] and ks_up_to(6) == [1, 2, 4, 6]


def test_evaluations_run_before_step_0_every_n_steps_and_after_the_last(controller_factory):
    c = controller_factory({"eval": EVAL, "train": {"total_steps": 3}})
    history = c.fit()
    assert [m["step"] for m in history] == [0, 1, 2, 3]
    evaluated = [m["step"] for m in history if "eval/held/pass@1" in m]
    assert evaluated == [0, 2, 3]
    final = history[-1]
    assert set(final) == {"step"} | {k for k in final if k.startswith("eval/held/")}  # the last: eval alone
    # the fake engine answers even samples right and odd ones wrong: 2 of 4 answers of every prompt
    assert final["eval/held/pass@1"] == pytest.approx(0.5) and final["eval/held/reward_mean"] == pytest.approx(0.5)
    assert final["eval/held/pass@2"] == pytest.approx(1 - 1 / 6) and final["eval/held/pass@4"] == 1.0
    assert final["eval/held/prompts"] == 6.0 and final["eval/held/turns_mean"] == 1.0
    assert final["eval/held/reward/exact_match"] == pytest.approx(0.5)
    lines = [json.loads(x) for x in (c.run.output_dir / "trained_prompts.jsonl").read_text().splitlines()]
    assert all(not p.startswith("held") for e in lines for p in e["prompt_ids"])  # never trained on


def test_an_evaluation_changes_nothing_of_the_training(controller_factory):
    """The same job with and without [eval]: the same data drawn, the same updates, the same weights."""
    plain = controller_factory({"train": {"total_steps": 2}})
    with_eval = controller_factory({"eval": {**EVAL, "every": 1}, "train": {"total_steps": 2}})
    a, b = plain.fit(), with_eval.fit()
    for ma, mb in zip(a, b):
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/adv_abs_mean"):
            assert ma[key] == mb[key], key
    assert plain.run.mixer.state_dict() == with_eval.run.mixer.state_dict()
    weights_a = plain.trainer.worker.model.state_dict()
    weights_b = with_eval.trainer.worker.model.state_dict()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert "eval/held/pass@1" in b[0] and "eval/held/pass@1" not in a[0]


def test_greedy_evaluation_samples_at_temperature_0(controller_factory):
    c = controller_factory({"eval": {**EVAL, "greedy": True, "samples": 1}, "train": {"total_steps": 1}})
    seen = []
    generate = c.engine.generate

    async def spy(input_ids, sampling_params, **kw):
        seen.append(sampling_params)
        return await generate(input_ids, sampling_params, **kw)

    c.engine.generate = spy
    c.run.evaluate(0)
    temperatures = {p["temperature"] for params in seen for p in (params if isinstance(params, list) else [params])}
    assert temperatures == {0.0}
