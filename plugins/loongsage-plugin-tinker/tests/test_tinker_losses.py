"""The policy-gradient losses and client-side custom losses through the service's train worker."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def _rl_datum(tokens: list[int], sampling_logprobs: np.ndarray, advantage: float) -> Any:
    from tinker import types

    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": sampling_logprobs.tolist(),
                                       "advantages": [advantage] * n})


def _logprobs(tc: Any, tokens: list[int]) -> np.ndarray:
    from tinker import types

    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_ppo_clips_and_importance_sampling_does_not(client: Any) -> None:
    """With every ratio at e (far above clip_high_threshold) and positive advantages, PPO's
    objective is the clipped constant: no gradient, the step changes nothing. Importance sampling
    on the same data does move the weights, and both report the loss of their formula."""
    from tinker import types

    tc = client.create_lora_training_client(base_model="tiny", rank=0).result()
    tokens = tc.get_tokenizer().encode("one two three four five")
    before = _logprobs(tc, tokens)
    datum = _rl_datum(tokens, before - 1.0, 1.0)
    out = tc.forward_backward([datum], "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
    assert out.metrics["loss:sum"] == pytest.approx(-1.2 * len(before), rel=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    np.testing.assert_array_equal(_logprobs(tc, tokens), before)

    out = tc.forward_backward([datum], "importance_sampling").result()
    assert out.metrics["loss:sum"] == pytest.approx(-np.e * len(before), rel=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = _logprobs(tc, tokens)
    assert after.sum() > before.sum()  # positive advantages: the sampled tokens got likelier


def test_a_client_side_custom_loss_trains(client: Any) -> None:
    """``forward_backward_custom``: the SDK differentiates the loss itself and sends the gradient
    as cross_entropy weights; the service's backward pass follows it."""
    import torch
    from tinker import types

    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    tokens = tc.get_tokenizer().encode("custom losses run on the client")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})

    def squared_nll(data: list[Any], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum((lp ** 2).sum() for lp in logprobs)
        return loss, {"squared_nll": float(loss)}

    losses = []
    for _ in range(4):
        out = tc.forward_backward_custom([datum], squared_nll).result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        losses.append(out.metrics["squared_nll"])
    assert losses[-1] < losses[0], losses


def test_compute_logprobs_scores_the_prompt_with_the_sampled_weights(client: Any) -> None:
    """``SamplingClient.compute_logprobs`` (a sample request with ``prompt_logprobs``): each prompt
    token's log-prob given the tokens before it, ``None`` first, equal to the training model's own
    log-probs of the same tokens; with ``prompt_logprobs_last_n`` only the last N are scored; the
    top-k of prompt and sampled positions come with their tokens, the most likely first."""
    import tinker
    from tinker import types

    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    tokens = tc.get_tokenizer().encode("the scores of a prompt under the sampled weights")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(tokens)
    scores = sampler.compute_logprobs(prompt).result()
    trained = _logprobs(tc, tokens)
    assert len(scores) == len(tokens) and scores[0] is None
    np.testing.assert_allclose(np.array(scores[1:], dtype=np.float64), trained, atol=2e-4)
    last = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=3).result()
    assert last[:-3] == [None] * (len(tokens) - 3)
    np.testing.assert_allclose(np.array(last[-3:], dtype=np.float64), trained[-3:], atol=2e-4)

    out = sampler.sample(prompt=prompt, num_samples=2, include_prompt_logprobs=True, topk_prompt_logprobs=3,
                         sampling_params=types.SamplingParams(max_tokens=4, seed=1, stop=[])).result()
    assert out.prompt_logprobs[1:] == pytest.approx(scores[1:], abs=1e-5)
    top = out.topk_prompt_logprobs
    assert len(top) == len(tokens) and top[0] is None
    for row, token, score in zip(top[1:], tokens[1:], scores[1:]):
        assert len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1] >= score - 1e-5
        assert all(lp == pytest.approx(score, abs=1e-5) for t, lp in row if t == token)
    sampled = sampler.sample(prompt=prompt, num_samples=2, topk_sample_logprobs=2,
                             sampling_params=types.SamplingParams(max_tokens=4, seed=1, stop=[])).result()
    assert sampled.prompt_logprobs is None
    for seq in sampled.sequences:
        assert len(seq.topk_logprobs) == 4
        for row, token, lp in zip(seq.topk_logprobs, seq.tokens, seq.logprobs):
            assert len(row) == 2 and row[0][1] >= row[1][1] and row[0][1] >= lp - 1e-5
            assert all(value == pytest.approx(lp, abs=1e-5) for t, value in row if t == token)
    with pytest.raises(tinker.RequestFailedError, match="prompt_logprobs_last_n must be between 1 and"):
        sampler.compute_logprobs(prompt, prompt_logprobs_last_n=len(tokens)).result()


def test_forward_needs_only_the_targets(client: Any) -> None:
    """A forward pass (what a client-side custom loss runs first) takes datums with only
    ``target_tokens``; cross_entropy then weighs each token 1."""
    from tinker import types

    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    tokens = tc.get_tokenizer().encode("only the targets")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:]})
    out = tc.forward([datum], "cross_entropy").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert len(logprobs) == len(tokens) - 1 and (logprobs < 0).all()
    assert out.metrics["loss:sum"] == pytest.approx(-float(logprobs.sum()), rel=1e-5)


def test_seeded_samples_are_reproducible_and_distinct(client: Any) -> None:
    from tinker import types

    sampler = client.create_sampling_client(base_model="tiny")
    params = types.SamplingParams(max_tokens=8, stop=[], seed=11)

    def draw() -> list[list[int]]:
        out = sampler.sample(prompt=types.ModelInput.from_ints([5, 6, 7]), num_samples=3, sampling_params=params)
        return [list(s.tokens) for s in out.result().sequences]

    first = draw()
    assert first == draw()
    assert len({tuple(t) for t in first}) == 3
